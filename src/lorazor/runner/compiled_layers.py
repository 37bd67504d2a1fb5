"""Regional compilation: torch.compile traces one decoder layer and every layer reuses it.

Compiling the whole decoder traces all of its layers (tens of seconds per compile, four compiles
per engine: decode and packed steps, with and without LoRA). The layers of a model run the same
code, so LoRazor compiles a layer class's `forward` once and calls it for each layer, with the layer
as an argument: dynamo's guards hold for every layer (their weights are inputs, and the layer number
stays a symbolic int, see `layer_stack.py`), so a step kind compiles a few times whatever the
depth (batch 1 apart). The layer number is marked dynamic before the first compile
(`layer_number_sources`): left to dynamo, the first layer's call would compile once more,
specialized on layer 0. The final norm and the rotary embedding are compiled the same way. The
embedding lookup and the glue between regions run eagerly (inside the step's CUDA graph, so their
Python costs nothing at replay).

Regions run compiled only inside `active()`: the runner's compiled steps. Every other forward
(`generate()`'s prefill, eager steps, `model.forward`) runs the layers' own code.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from .compile_cache import use_compile_cache

# Specializations allowed per region (step kinds x batch classes x grid layouts): more than dynamo's
# default limit of 8, past which it would silently run the region eagerly.
REGION_VARIANTS = 256


def mark_rows_dynamic(value) -> None:
    """Let torch.compile treat the batch and token counts of a step as dynamic in every tensor of
    `value` (a tensor, or a tuple/list of them): every dim of an integer or bool tensor (positions
    `[B, 1]` or `[1, N]`, masks), every dim but the last of a float tensor (hidden states `[B, 1, H]`
    or `[1, N, H]`, RoPE's cos/sin), whose last dim is a model width and stays static."""
    if isinstance(value, torch.Tensor):
        counts = value.dim() - 1 if value.is_floating_point() else value.dim()
        for dim in range(counts):
            torch._dynamo.maybe_mark_dynamic(value, dim)
    elif isinstance(value, (tuple, list)):
        for item in value:
            mark_rows_dynamic(item)


def layer_number_sources(layer: nn.Module) -> str:
    """Dynamo's names for the integer layer numbers (HF's `layer_idx`) inside a decoder layer, as
    `torch.compiler.config.dynamic_sources` takes them: marked dynamic from the first compile, the
    layer number costs no compile specialized on layer 0 that the second layer would throw away.
    Each is spelled as torch 2.13 names a submodule's attribute (`_modules['...']`) and as older
    versions did (a dotted path); an entry that names no source is ignored."""
    names = []
    for path, module in layer.named_modules():
        if isinstance(getattr(module, "layer_idx", None), int) and not isinstance(module.layer_idx, bool):
            parts = path.split(".") if path else []
            names.append("L['self']" + "".join(f"._modules['{p}']" for p in parts) + ".layer_idx")
            names.append(".".join(["L['self']", *parts, "layer_idx"]))
    return ",".join(names)


class CompiledLayers:
    """Installs compiled regions on a decoder's layers, final norm and rotary embedding."""

    def __init__(self, decoder: nn.Module):
        self.active_regions = False
        self.cache_dirs = use_compile_cache()  # before anything compiles: see compile_cache.py
        layers = getattr(decoder, "layers", None)
        if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
            raise ValueError(f"compile=True needs a decoder with a `layers` ModuleList; "
                             f"{type(decoder).__name__} has none")
        modules = list(layers)
        modules += [m for name, m in decoder.named_children()
                    if name == "norm" or type(m).__name__.endswith("RotaryEmbedding")]
        self.modules = modules
        self.dynamic_sources = layer_number_sources(layers[0])
        compiled = {}  # one compiled forward per module class
        for module in modules:
            cls = type(module)
            if cls not in compiled:
                compiled[cls] = torch.compile(cls.forward)
            self._install(module, compiled[cls])
        # The code object dynamo files each region's compiled frames under: the function it traces.
        # For a forward whose outer function is torch's own (`@torch.no_grad()` on a rotary embedding
        # in some transformers versions) that is dynamo's wrapper, not `cls.forward`; its code is
        # shared by every region wrapped so, whose counts are then one sum.
        self._codes = {cls: getattr(fn, "_torchdynamo_orig_callable", cls.forward).__code__
                       for cls, fn in compiled.items()}

    def compiles(self) -> dict[str, int]:
        """Dynamo's compiled entries per region class (its code object's, in every model so far)."""
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        return {cls.__name__: len(_debug_get_cache_entry_list(code)) for cls, code in self._codes.items()}

    def _install(self, module: nn.Module, compiled) -> None:
        eager = module.forward

        def forward(*args, **kwargs):
            if not self.active_regions:
                return eager(*args, **kwargs)
            for value in (*args, *kwargs.values()):
                mark_rows_dynamic(value)
            return compiled(module, *args, **kwargs)

        module.forward = forward

    def remove(self) -> None:
        """Give every module its own `forward` back (`LoRazorModel.unpatch`)."""
        for module in self.modules:
            module.__dict__.pop("forward", None)

    def _with_users_sources(self) -> str:
        """The layer numbers' sources after any the user set (`TORCH_COMPILE_DYNAMIC_SOURCES`)."""
        return ",".join(filter(None, (torch.compiler.config.dynamic_sources, self.dynamic_sources)))

    @contextmanager
    def active(self):
        """Run the regions compiled within this block (the runner's compiled steps)."""
        self.active_regions = True
        try:
            with torch._dynamo.config.patch(recompile_limit=REGION_VARIANTS, allow_unspec_int_on_nn_module=True), \
                    torch.compiler.config.patch(dynamic_sources=self._with_users_sources()):
                yield
        finally:
            self.active_regions = False
