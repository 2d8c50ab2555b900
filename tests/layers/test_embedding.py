import torch

from atom_core.layers.embedding import ParallelLMHead, VocabParallelEmbedding


def test_embedding_and_untied_head():
    emb, head = VocabParallelEmbedding(10, 4), ParallelLMHead(10, 4)
    w, wh = torch.randn(10, 4), torch.randn(10, 4)
    emb.weight.weight_loader(emb.weight, w)
    head.weight.weight_loader(head.weight, wh)
    ids = torch.tensor([3, 0, 9])
    torch.testing.assert_close(emb(ids), w[ids])
    h = torch.randn(2, 4, dtype=torch.float32)
    torch.testing.assert_close(head(h), h @ wh.T)


def test_tied_head_shares_the_embedding_and_returns_model_dtype_logits():
    emb, head = VocabParallelEmbedding(10, 4), ParallelLMHead(10, 4)
    head.tie_to(emb)
    emb.weight.weight_loader(emb.weight, torch.randn(10, 4))
    assert head.weight is emb.weight and head.tied
    x = torch.randn(3, 4)
    logits = head(x)
    assert logits.dtype == torch.float32 and logits.shape == (3, 10)
    emb.bfloat16()
    # No widening copy: the bf16 product itself (the sampler widens where it computes).
    narrow = head(x.bfloat16())
    assert narrow.dtype == torch.bfloat16
    assert torch.equal(narrow, torch.nn.functional.linear(x.bfloat16(), emb.weight))
