"""Every extension point of ATOM, in one file.

A plugin is a module with ``@hookimpl`` functions, named in its distribution's
``[project.entry-points.atom]`` table. Each hook receives ``register``: call it once per
thing you provide. A plugin that cannot serve this machine calls
``register.decline("one-line reason")`` instead and returns; declining never raises.

The core's own defaults (torch reference ops, the native attention backend) register
through these same hooks, so every name you see in ``atom plugins`` got there one way.

Adding a hook is adding a function here under ``@extension_point(attribute, registry)``:
each plugin's implementation is called with a ``register`` that feeds the registry's
``register`` method, and the code that uses the hook reads ``get_registries().<attribute>``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pluggy

from atom_core.registries import (
    AttentionBackendRegistry,
    ExtensionPoint,
    NamedRegistry,
    OpRegistry,
    Registry,
)

hookspec = pluggy.HookspecMarker("atom")
hookimpl = pluggy.HookimplMarker("atom")

Spec = TypeVar("Spec", bound=Callable[..., object])


def extension_point(attribute: str, registry: Callable[[], Registry]) -> Callable[[Spec], Spec]:
    """Make the decorated function a hook whose ``register`` calls fill ``registry()``."""

    def declare(spec: Spec) -> Spec:
        point = ExtensionPoint(spec.__name__, attribute, registry)
        spec.atom_extension_point = point  # type: ignore[attr-defined]
        return hookspec(spec)

    return declare


@extension_point("architectures", lambda: NamedRegistry("model architecture"))
def register_model_architectures(register):
    """Provide model classes, keyed by Hugging Face architecture name.

    Call ``register(name, model_cls)`` where ``name`` is the string that appears in
    ``config.json``'s ``architectures[0]`` (e.g. ``"LlamaForCausalLM"``) and ``model_cls``
    is an ``nn.Module`` subclass built as ``model_cls(hf_config)``. The engine picks the
    class whose name equals the checkpoint's architecture. Two distributions registering
    the same name is an error at start-up.
    """


@extension_point("ops", OpRegistry)
def register_ops(register):
    """Provide implementations of named fused ops.

    Call ``register(op_name, fn, provider=..., device_kinds=(...), priority=0)``.
    ``op_name`` is one of the core's op names (``rms_norm``, ``fused_add_rms_norm``,
    ``silu_and_mul``, ...) with the signature of the native reference in
    ``atom_core.ops.native``; ``provider`` names the implementation family (``native``,
    ``triton``, ``aiter``); ``device_kinds`` lists where it runs (``cpu``, ``cuda``,
    ``hip``). For each op the implementation with the highest priority that supports the
    current device wins; ``ATOM_OPS_PROVIDER=name`` forces one provider.
    """


@extension_point("attention_backends", AttentionBackendRegistry)
def register_attention_backends(register):
    """Provide paged attention backends.

    Call ``register(name, backend_cls, device_kinds=(...), kind="mha", priority=0)``;
    ``kind`` is ``"mha"`` (MHA/GQA over a paged K/V cache) or ``"mla"`` (latent cache).
    The engine uses the highest-priority backend of the model's kind that supports the
    current device.
    """


@extension_point("proposers", lambda: NamedRegistry("spec-decode method"))
def register_spec_decode_proposers(register):
    """Provide speculative-decoding draft proposers.

    Call ``register(method, factory)``; ``method`` is the value users pass to ``--method``
    (``ngram``, ``draft_model``, ``mtp``, ``eagle3``). Names are unique across plugins.
    ``factory(ctx)`` gets an ``atom_core.spec_decode.proposer.ProposerContext`` (the
    flags, the target model, device and dtype) and returns a ``TokenProposer`` (drafts
    from the token ids) or a ``DraftNetwork`` (a model the engine runs beside the target);
    that module says what each provides. engine/spec_decode.py verifies the drafts.
    """


@extension_point("tool_formats", lambda: NamedRegistry("tool-call format"))
def register_tool_formats(register):
    """Provide tool-call wire formats.

    Call ``register(name, format_cls)``; ``name`` is what users pass to
    ``--tool-call-parser``. ``format_cls`` subclasses
    ``atom_core.parsing.ToolFormat`` and declares syntax only:
    ``START_MARKERS``, ``opens_region(marker)``, ``parse_region(text, at_end)`` returning a
    ``RegionParse`` (the calls, and where the format's markup starts and ends) or None for
    "not a call (yet)", its closers (``CALL_SELF_CLOSERS``, ``REGION_END_MARKERS``,
    ``WRAPPER_CLOSERS``) and a ``TEMPLATE_SIGNATURE`` that ``--tool-call-parser auto``
    looks for in the chat template rendered with tools. The core reads the stream; a
    format never does. Names are unique across plugins.
    """


@extension_point("reasoning_dialects", lambda: NamedRegistry("reasoning dialect"))
def register_reasoning_dialects(register):
    """Provide reasoning-channel dialects.

    Call ``register(name, dialect_cls)``; the dialect declares its channel delimiters and a
    template signature used to detect it from a chat template. Names are unique across
    plugins.
    """
