"""ReplayForCausalLM: a model that replays a script of token ids through the real engine.

End-to-end tests of the server need a model whose output they choose: the tool-call and
reasoning readers are tested on exact texts, and a random tiny model writes none of
them. This one is a real ATOM model - registered through ``register_model_architectures``,
loaded from a checkpoint directory, run by the model runner over the paged KV cache (its
one Attention layer is computed and ignored) - whose logits put the whole probability mass
on the next script token, and on EOS once the script is spent. Text goes in through the
real tokenizer (the test encodes it) and comes out through the real detokenizer.

See ``model.py`` for how a script is keyed to a request, and ``checkpoint.py`` to write a
model directory.
"""
