import pytest
import torch
from atom_kernels_aiter import hooks

from atom_core.ops.native.activation import silu_and_mul
from atom_core.ops.native.norm import fused_add_rms_norm, rms_norm
from atom_core.plugins import build_plugin_state


def test_declines_with_reason_without_rocm():
    reason = hooks.unavailable_reason()
    state = build_plugin_state()
    report = next(r for r in state.reports if r.name == "atom-kernels-aiter")
    if reason is None:
        pytest.skip("this machine has ROCm and aiter")
    assert report.declined == reason
    assert report.registered == {}
    assert all(i.provider != "aiter"
               for impls in state.registries.ops.impls.values() for i in impls)


@pytest.mark.skipif(hooks.unavailable_reason() is not None, reason="needs ROCm + aiter")
def test_aiter_ops_match_reference():
    ops = hooks._ops()
    x = torch.randn(7, 256, dtype=torch.bfloat16, device="cuda")
    r = torch.randn_like(x)
    w = torch.randn(256, dtype=torch.bfloat16, device="cuda")
    torch.testing.assert_close(ops["rms_norm"](x, w, 1e-6), rms_norm(x, w, 1e-6),
                               atol=2e-2, rtol=2e-2)
    y, s = ops["fused_add_rms_norm"](x, r, w, 1e-6)
    y_ref, s_ref = fused_add_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(y, y_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(s, s_ref, atol=2e-2, rtol=2e-2)
    g = torch.randn(7, 512, dtype=torch.bfloat16, device="cuda")
    torch.testing.assert_close(ops["silu_and_mul"](g), silu_and_mul(g), atol=2e-2, rtol=2e-2)
