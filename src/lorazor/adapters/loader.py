"""PEFT adapter folders: the config and the weights' header at registration, the weights at load.

A folder holds `adapter_config.json` and `adapter_model.safetensors` (or PEFT's older
`adapter_model.bin`, read with `torch.load(weights_only=True)`: tensors only). Registration reads
the JSON and the tensors and checks them (shapes against the model, every value finite, a tensor
pair for every module its `target_modules` select, as PEFT requires), so a bad folder is refused
before any weights move to the GPU and a load between two engine steps finds nothing new to fail
on; the tensors are read again when the adapter is first loaded. Tensor keys are PEFT's
(`base_model.model.<module>.lora_A.weight`); modules are named as in the Hugging Face model
(`model.layers.0.self_attn.q_proj`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .files import FILE_OVERHEAD_BYTES, check_archive, check_inside_root, check_unchanged, digest_of, fd_path, \
    open_file, weights_bound
from .names import ADAPTER_NAME, CONFIG_FILE, LEGACY_FILE, SAFE_FILE, adapter_name_problem  # noqa: F401 (re-exported)
from ..lora.types import AdapterError, AdapterWeights
from ..config import int_in_range

PEFT_PREFIX = "base_model.model."
# The largest `adapter_config.json` read (PEFT's are a few KiB); larger ones are refused unread.
MAX_CONFIG_BYTES = 1 << 20
# The largest LoRA scaling (lora_alpha / r, or / sqrt(r) with rsLoRA) served: trained adapters use
# about 0.5-64; far larger ones overflow the activations and end every request of theirs with NaN.
MAX_SCALING = 1e4
# Config fields whose PEFT feature LoRazor cannot batch per row: (field, is set, why).
REFUSED_FEATURES = (
    ("use_dora", bool, "DoRA, which LoRazor does not support"),
    ("modules_to_save", bool, "modules_to_save: fully trained modules cannot be batched per row"),
    ("lora_bias", bool, "lora_bias=True, which LoRazor does not support"),
    ("fan_in_fan_out", bool, "fan_in_fan_out (Conv1D layers), which LoRazor does not support"),
    ("trainable_token_indices", bool, "trainable tokens (an embedding target), which LoRazor does not support"),
    ("alora_invocation_tokens", bool, "activated LoRA (aLoRA), which LoRazor does not support"),
    ("layer_replication", bool, "layer_replication, which LoRazor does not support"),
)
# `target_parameters` LoRazor serves: the fused experts of MoE layers (`lora/experts.py`).
EXPERT_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj")


def check_adapter_name(name) -> str:
    """Return `name` if it is a valid adapter name, else raise AdapterError naming it."""
    problem = adapter_name_problem(name)
    if problem:
        raise AdapterError(problem)
    return name


def check_lora_config(name: str, cfg) -> None:
    """Refuse adapter configs (a PEFT config object or its JSON dict) whose features LoRazor cannot serve."""
    get = cfg.get if isinstance(cfg, dict) else (lambda key, default=None: getattr(cfg, key, default))
    peft_type = get("peft_type")
    if str(getattr(peft_type, "value", peft_type)) != "LORA":
        raise AdapterError(f"adapter {name!r} is {peft_type}, only LoRA adapters are supported")
    for key, is_set, why in REFUSED_FEATURES:
        if is_set(get(key)):
            raise AdapterError(f"adapter {name!r} uses {why} ({key}={get(key)!r})")
    for parameter in get("target_parameters") or ():
        if not str(parameter).endswith(EXPERT_PARAMETERS):
            raise AdapterError(f"adapter {name!r} targets parameter {parameter!r} (target_parameters): LoRazor serves "
                               f"target_parameters only on MoE experts ({', '.join(EXPERT_PARAMETERS)})")


def per_expert_tensors(name: str, cfg: dict, tensors: dict[str, torch.Tensor],
                       module_sizes: dict | None = None) -> dict[str, torch.Tensor]:
    """`tensors` with MoE expert LoRA under the bank's per-expert module names (`lora/experts.py`):
    PEFT's fused `target_parameters` pairs split per expert (which parameter a pair is follows from
    its shapes and the model's: without `module_sizes` they stay as they are), older per-expert
    names (Mixtral's `block_sparse_moe.experts.<e>.w1`) renamed; every other tensor as it is."""
    from ..lora.experts import canonical_module, fused_prefix, split_fused_pair

    out, fused = {}, {}
    for key, tensor in tensors.items():
        module, kind = module_of_key(key)
        prefix = fused_prefix(module) if module else None
        if prefix is None or module_sizes is None:
            out[key if not module else f"{PEFT_PREFIX}{canonical_module(module)}.lora_{kind}.weight"] = tensor
        else:
            fused.setdefault(module, {})[kind] = tensor
    for module, pair in fused.items():
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r} has lora_{'A' if 'A' not in pair else 'B'} missing for {module}")
        prefix = fused_prefix(module)
        a, b = pair["A"], pair["B"]
        gate = module_sizes.get(f"{prefix}.0.gate_proj")
        if gate is None:
            raise AdapterError(f"adapter {name!r} puts LoRA on {module}, which is not an MoE experts module of this "
                               "model that takes adapters")
        hidden, inter = gate  # which parameter, from the shapes: gate_up is H -> 2I, down I -> H
        projection = ("gate_up_proj" if (a.shape[1], b.shape[0]) == (hidden, 2 * inter) else
                      "down_proj" if (a.shape[1], b.shape[0]) == (inter, hidden) else None)
        if projection is None:
            raise AdapterError(f"adapter {name!r}: {module} has lora_A {tuple(a.shape)} and lora_B "
                               f"{tuple(b.shape)}, which fit neither experts.gate_up_proj ({hidden} -> "
                               f"{2 * inter}) nor experts.down_proj ({inter} -> {hidden}) of this model")
        experts = 0
        while f"{prefix}.{experts}.gate_proj" in module_sizes:
            experts += 1
        rank = module_rank_alpha(cfg, f"{prefix}.{projection}")[0]
        if a.shape[0] != rank * experts or b.shape[1] != a.shape[0]:
            raise AdapterError(f"adapter {name!r}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                               f"this model's {experts} experts at r={rank} need lora_A [{rank * experts}, "
                               f"{a.shape[1]}] and lora_B [{b.shape[0]}, {rank * experts}] (an adapter for another "
                               "expert count?)")
        for expert_module, a_e, b_e in split_fused_pair(a, b, experts, prefix, projection):
            out[f"{PEFT_PREFIX}{expert_module}.lora_A.weight"] = a_e
            out[f"{PEFT_PREFIX}{expert_module}.lora_B.weight"] = b_e
    return out


def module_rank_alpha(cfg: dict, module: str) -> tuple[int, float]:
    """The rank and alpha PEFT gives `module`: `rank_pattern` / `alpha_pattern` entries whose key
    matches the end of the module name, else the config's `r` / `lora_alpha`."""
    from peft.utils.other import get_pattern_key

    ranks, alphas = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    rank = ranks.get(get_pattern_key(ranks.keys(), module), cfg["r"])
    return rank, alphas.get(get_pattern_key(alphas.keys(), module), cfg.get("lora_alpha", 8))


def module_of_key(key: str) -> tuple[str, str]:
    """PEFT tensor key -> (module name in the HF model, "A" or "B"); ("", "") for anything else."""
    module, _, kind = key.rpartition(".lora_")
    if kind not in ("A.weight", "B.weight"):
        return "", ""
    return module.removeprefix(PEFT_PREFIX), kind[0]


@dataclass
class AdapterSource:
    """A registered adapter folder, validated, weights not read.

    Attributes:
        name, path: the adapter and its folder.
        config: the parsed `adapter_config.json`.
        shapes: module -> (A shape, B shape), from the safetensors header or the `.bin` tensors.
        max_rank: the largest rank over its modules.
        digest: a hash of its config and weights (`weights_digest`): the prefix cache keys the KV
            an adapter computes by it, so other weights under the same name never share blocks.
        root: the server's `--lora-root` it was registered under (None: none); every later read
            then opens its files without following links (`files.py`).
    """

    name: str
    path: Path
    config: dict
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] | None
    max_rank: int
    digest: bytes = b""
    root: Path | None = None


def weights_digest(config: dict, tensors: dict[str, torch.Tensor]) -> bytes:
    """sha256 of an adapter's config (as JSON, keys sorted) and of every tensor's name, dtype,
    shape and bytes, in name order."""
    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for key in sorted(tensors):
        tensor = tensors[key].detach().contiguous()
        h.update(f"\0{key}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        h.update(tensor.cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


def check_shapes(name: str, module: str, a_shape, b_shape, rank: int, in_features: int, out_features: int) -> None:
    """A `[rank, in]` and B `[out, rank]`, or an error naming the module and what disagrees."""
    if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != rank or b_shape[1] != rank:
        raise AdapterError(f"adapter {name!r}: {module} has lora_A {tuple(a_shape)} and lora_B {tuple(b_shape)}, "
                           f"which disagree with the config's r={rank}")
    if a_shape[1] != in_features or b_shape[0] != out_features:
        raise AdapterError(
            f"adapter {name!r} was trained for another model: {module} expects lora_A [r, {in_features}] and "
            f"lora_B [{out_features}, r], the folder has {tuple(a_shape)} and {tuple(b_shape)}")


def config_bytes(name: str, folder: Path, root: Path | None = None) -> bytes:
    path = folder / CONFIG_FILE
    if not folder.is_dir():
        raise AdapterError(f"adapter {name!r}: {folder} does not exist or is not a folder")
    if not path.is_file() and not path.is_symlink():
        raise AdapterError(f"adapter {name!r}: {folder} has no {CONFIG_FILE} (not a PEFT adapter folder)")
    with open_file(name, path, root) as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_CONFIG_BYTES:
            raise AdapterError(f"adapter {name!r}: {path} is {size} bytes, more than the "
                               f"{MAX_CONFIG_BYTES} an adapter config may have")
        return f.read()


def _read_config(name: str, folder: Path, raw: bytes) -> dict:
    path = folder / CONFIG_FILE
    try:
        cfg = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise AdapterError(f"adapter {name!r}: {path} is not valid JSON ({err})") from err
    except RecursionError as err:  # nested deeper than Python's parser goes
        raise AdapterError(f"adapter {name!r}: {path} is nested too deeply to be an adapter config") from err
    if not isinstance(cfg, dict):
        raise AdapterError(f"adapter {name!r}: {path} must hold a JSON object, got a {type(cfg).__name__}")
    check_lora_config(name, cfg)
    rank = cfg.get("r")
    if not int_in_range(rank, 1):
        raise AdapterError(f"adapter {name!r}: {path} has r={rank!r}, expected a positive int")
    patterns = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    if not all(isinstance(p, dict) for p in patterns):
        raise AdapterError(f"adapter {name!r}: {path} has a rank_pattern or alpha_pattern that is not an object")
    for key, value in patterns[0].items():
        if not int_in_range(value, 1):
            raise AdapterError(f"adapter {name!r}: {path} has rank_pattern[{key!r}]={value!r}, expected a positive int")
    for key, value in [("lora_alpha", cfg.get("lora_alpha", 8)), *patterns[1].items()]:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            where = key if key == "lora_alpha" else f"alpha_pattern[{key!r}]"
            raise AdapterError(f"adapter {name!r}: {path} has {where}={value!r}, expected a finite number > 0")
        rank_of = rank if key == "lora_alpha" else patterns[0].get(key, rank)
        scaling = value / (rank_of**0.5 if cfg.get("use_rslora") else rank_of)
        if scaling > MAX_SCALING:
            where = key if key == "lora_alpha" else f"alpha_pattern[{key!r}]"
            raise AdapterError(f"adapter {name!r}: {path} has {where}={value!r}, a LoRA scaling of {scaling:.3g} "
                               f"(alpha / r), more than the {MAX_SCALING:g} LoRazor serves: its outputs would overflow")
    return cfg


def _header_shapes(name: str, path: Path, opened: str | None = None) -> dict:
    """The tensors' shapes from a safetensors header (`opened`: a path to the very file already
    open, see `files.fd_path`); a corrupt header or a non-float dtype is refused."""
    from safetensors import safe_open

    try:
        with safe_open(opened or str(path), framework="pt") as f:
            slices = {key: f.get_slice(key) for key in f.keys()}
            shapes = {key: tuple(s.get_shape()) for key, s in slices.items()}
            dtypes = {key: s.get_dtype() for key, s in slices.items()}
    except Exception as err:  # safetensors raises its own error types for a corrupt header
        raise AdapterError(f"adapter {name!r}: {path} is not a valid safetensors file ({err})") from err
    bad = {key: dtype for key, dtype in dtypes.items() if dtype not in SAFE_FLOAT_DTYPES}
    if bad:
        key, dtype = next(iter(bad.items()))
        raise AdapterError(f"adapter {name!r}: tensor {key!r} in {path} has dtype {dtype}, not a floating type")
    return _pair_shapes(name, shapes)


# safetensors' names of the floating dtypes an adapter's weights may have.
SAFE_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def _pair_shapes(name: str, shapes: dict) -> dict:
    _check_inside_decoder(name, {}, shapes)
    pairs: dict[str, dict[str, tuple]] = {}
    for key, shape in shapes.items():
        module, kind = module_of_key(key)
        if not module:
            raise AdapterError(f"adapter {name!r} has an unexpected tensor {key!r}")
        pairs.setdefault(module, {})[kind] = shape
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r} has lora_{'A' if 'A' not in pair else 'B'} missing for {module}")
    return {module: (pair["A"], pair["B"]) for module, pair in pairs.items()}


# Modules outside the decoder's linear layers: LoRA on them is refused, naming them.
OUTSIDE_DECODER = ("lm_head", "embed_tokens", "wte", "embed_out")


def resolve_adapter_folder(name: str, path, allow_hub: bool) -> Path:
    """The local folder of `path`, or with `allow_hub` the Hugging Face Hub snapshot of a repo id
    `owner/name` that is not a local path (`huggingface_hub.snapshot_download`: its cache and
    `HF_HUB_OFFLINE` apply; only the adapter's config and weights are fetched)."""
    folder = Path(path)
    text = str(path)
    if folder.exists() or not allow_hub or text.count("/") != 1 or text.startswith((".", "/", "~")):
        return folder
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(text, allow_patterns=[CONFIG_FILE, SAFE_FILE, LEGACY_FILE]))
    except Exception as err:  # offline and not cached, unknown repo, no network: say which
        raise AdapterError(f"adapter {name!r}: there is no local folder {text!r}; taken as a Hugging Face Hub repo id, "
                           f"fetching it failed ({type(err).__name__}: {err})") from None


def _check_inside_decoder(name: str, cfg: dict, keys) -> None:
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    found = sorted({m for m in OUTSIDE_DECODER for t in [*targets, *keys] if m in str(t)})
    if found:
        raise AdapterError(f"adapter {name!r} puts LoRA on {', '.join(found)}: LoRazor serves LoRA on the "
                           "decoder's linear layers only (attention and MLP projections)")


def read_adapter(name: str, path, allow_hub: bool = False, root: Path | None = None,
                 module_sizes: dict[str, tuple[int, int]] | None = None, max_rank: int | None = None) -> AdapterSource:
    """Validate an adapter folder: its config, then its tensors' names, shapes and values (the
    module docstring lists the checks). The tensors are not kept: they are read again at the first
    load. Thread-safe: nothing is registered here, so a server runs it off its engine's loop.

    Args:
        allow_hub: a Hub repo id that is not a local folder is fetched (`resolve_adapter_folder`).
        root: the server's `--lora-root` the folder must stay under (links refused at every read).
        module_sizes, max_rank: the bank's LoRA targets and rank bound: with them, names, shapes and
            the file's size are checked against the model before any value is read (a file larger
            than this model's adapters can be is refused unread, `files.weights_bound`).
    """
    check_adapter_name(name)
    folder = resolve_adapter_folder(name, path, allow_hub)
    if root is not None:
        folder = Path(os.path.realpath(folder))
        check_inside_root(name, folder, root)
    raw = config_bytes(name, folder, root)
    cfg = _read_config(name, folder, raw)
    _check_inside_decoder(name, cfg, ())
    if not os.path.lexists(folder / SAFE_FILE) and not os.path.lexists(folder / LEGACY_FILE):
        raise AdapterError(f"adapter {name!r}: no {SAFE_FILE} or {LEGACY_FILE} in {folder}")
    source = AdapterSource(name, folder, cfg, None, cfg["r"], root=root)
    bound = None if module_sizes is None else weights_bound(module_sizes, max_rank or cfg["r"])
    tensors, digest = read_tensors(source, bound, raw)
    tensors = per_expert_tensors(name, cfg, tensors, module_sizes)
    shapes = _pair_shapes(name, {key: tuple(t.shape) for key, t in tensors.items()})
    ranks = ([module_rank_alpha(cfg, module)[0] for module in shapes]
             or [cfg["r"], *(cfg.get("rank_pattern") or {}).values()])
    source = AdapterSource(name, folder, cfg, shapes, max(ranks), digest, root)
    if module_sizes is not None:  # names and shapes before values
        check_source(source, module_sizes, max_rank)
    # The values are read and checked now, so a bad file is refused at registration, never when a
    # request first needs it.
    check_finite(name, tensors)
    return source


def read_tensors(source: AdapterSource, max_bytes: int | None = None,
                 config: bytes | None = None) -> tuple[dict[str, torch.Tensor], bytes]:
    """(the folder's tensors, the digest of what was read): safetensors memory-mapped, or `.bin`
    through the weights-only unpickler once its archive is checked (`files.check_archive`). The
    digest is sha256 of the config's and the safetensors file's bytes (4x cheaper than hashing the
    tensors), or for a `.bin` file `weights_digest` of its config and tensors."""
    name = source.name
    if config is None:
        config = config_bytes(name, source.path, source.root)
    safe, legacy = source.path / SAFE_FILE, source.path / LEGACY_FILE
    use_safe = os.path.lexists(safe)
    path, kind = (safe, "safetensors") if use_safe else (legacy, "weights-only torch")
    with open_file(name, path, source.root) as f:
        try:
            if use_safe:
                size = os.fstat(f.fileno()).st_size
                if max_bytes is not None and size > max_bytes + FILE_OVERHEAD_BYTES:
                    raise AdapterError(f"adapter {name!r}: {path} is {size} bytes, more than an adapter of this "
                                       f"model at max_lora_rank can need ({max_bytes + FILE_OVERHEAD_BYTES})")
                from safetensors.torch import load_file

                _header_shapes(name, path, fd_path(f, path))  # a bad header or dtype refused before any data
                # Memory-mapped and aligned: tensors `safetensors.torch.load(bytes)` makes from a buffer
                # sum 50x slower.
                return load_file(fd_path(f, path)), digest_of(config, f)
            check_archive(name, f, path, max_bytes)
            tensors = torch.load(f, map_location="cpu", weights_only=True)
        except AdapterError:
            raise
        except Exception as err:  # safetensors / the weights-only unpickler raise their own error types
            raise AdapterError(f"adapter {name!r}: {path} is not a valid {kind} file ({err})") from err
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise AdapterError(f"adapter {name!r}: {legacy} does not hold a dict of tensors")
    for key, tensor in tensors.items():
        if not isinstance(key, str) or not tensor.dtype.is_floating_point:
            raise AdapterError(f"adapter {name!r}: tensor {key!r} in {legacy} has dtype {tensor.dtype}, "
                               "not a floating type")
    try:
        parsed = json.loads(config)
    except ValueError:  # changed into something else: its bytes stand for it
        parsed = {"raw": config.hex()}
    return tensors, weights_digest(parsed, tensors)


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value of `tensor` is finite, from its smallest and largest values in one pass
    (a NaN propagates into both, an infinity is one of them; no sum to overflow). On the CPU 15x
    faster than a float32 sum of bf16 values, 20x faster than `isfinite().all()`."""
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return math.isfinite(low.item()) and math.isfinite(high.item())


def check_finite(name: str, tensors: dict[str, torch.Tensor]) -> None:
    """Refuse an adapter with a NaN or infinite weight: it would turn its requests' logits to NaN.
    The count of bad values is computed only for the message."""
    for key, tensor in tensors.items():
        if not all_finite(tensor):
            bad = int((~torch.isfinite(tensor)).sum())
            raise AdapterError(f"adapter {name!r}: tensor {key!r} holds {bad} non-finite values (NaN or infinity)")


def targeted_modules(cfg: dict, modules) -> set[str] | None:
    """The modules among `modules` (the model's LoRA targets, HF names) that the config's
    `target_modules` select, by PEFT's own matching (suffixes or a regex, `exclude_modules`,
    `layers_to_transform`); None when the config names no targets."""
    from types import SimpleNamespace

    from peft.tuners.tuners_utils import check_target_module_exists

    targets = cfg.get("target_modules")
    if not targets:
        return None
    if targets == "all-linear":
        return set(modules)
    view = SimpleNamespace(target_modules=targets if isinstance(targets, str) else set(targets),
                           exclude_modules=cfg.get("exclude_modules"), modules_to_save=None, target_parameters=None,
                           layers_to_transform=cfg.get("layers_to_transform"), layers_pattern=cfg.get("layers_pattern"))
    from ..lora.experts import legacy_name

    return {module for module in modules if check_target_module_exists(view, module)
            or (legacy_name(module) is not None and check_target_module_exists(view, legacy_name(module)))}


def check_coverage(source: AdapterSource, module_sizes: dict) -> None:
    """Refuse a folder whose tensors cover none or only part of what its config targets, as PEFT
    refuses target modules it cannot find: served, such an adapter is silently the base model."""
    name = source.name
    if not source.shapes:
        raise AdapterError(f"adapter {name!r}: {source.path} holds no LoRA tensors")
    expected = targeted_modules(source.config, module_sizes)
    if expected is None:
        return
    if not expected:
        raise AdapterError(f"adapter {name!r}: its target_modules {source.config.get('target_modules')!r} match none "
                           f"of this model's LoRA target modules (e.g. {next(iter(module_sizes), None)!r})")
    missing = sorted(expected - set(source.shapes))
    if missing:
        raise AdapterError(f"adapter {name!r}: {source.path} has no weights for {len(missing)} of the {len(expected)} "
                           f"modules its target_modules select (e.g. {missing[0]}): the file is incomplete")


def load_adapter_weights(source: AdapterSource, module_sizes: dict[str, tuple[int, int]]) -> AdapterWeights:
    """Read an adapter's tensors (host memory) and check them against the bank's modules.

    Args:
        module_sizes: bank module name -> (in_features, out_features).
    """
    tensors, digest = read_tensors(source)
    check_unchanged(source.name, source.path, source.digest, digest)
    return adapter_weights(source, tensors, module_sizes)


def adapter_weights(source: AdapterSource, tensors: dict[str, torch.Tensor],
                    module_sizes: dict[str, tuple[int, int]]) -> AdapterWeights:
    """`tensors` (the folder's, read) checked against the bank's modules and paired per module."""
    check_finite(source.name, tensors)  # the file may have changed since registration
    tensors = per_expert_tensors(source.name, source.config, tensors, module_sizes)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        module, kind = module_of_key(key)
        if not module:
            raise AdapterError(f"adapter {source.name!r} has an unexpected tensor {key!r}")
        pairs.setdefault(module, {})[kind] = value
    _pair_shapes(source.name, {f"{m}.lora_{k}.weight": t.shape for m, p in pairs.items() for k, t in p.items()})
    weights = AdapterWeights()
    use_rslora = bool(source.config.get("use_rslora"))
    for module, pair in pairs.items():
        check_target(source.name, module, module_sizes)
        rank, alpha = module_rank_alpha(source.config, module)
        check_shapes(source.name, module, pair["A"].shape, pair["B"].shape, rank, *module_sizes[module])
        weights.modules[module] = (pair["A"], pair["B"], alpha / (rank**0.5 if use_rslora else rank))
    return weights


def check_target(name: str, module: str, module_sizes: dict) -> None:
    if module not in module_sizes:
        raise AdapterError(
            f"adapter {name!r} targets {module}, which is not among this model's LoRA targets (declare it with "
            "LoRazorConfig(lora_target_modules=...))")


def check_source(source: AdapterSource, module_sizes: dict[str, tuple[int, int]], max_rank: int) -> None:
    """Registration-time checks against the bank: rank bound, targets and shapes from the header."""
    if source.max_rank > max_rank:
        raise AdapterError(f"adapter {source.name!r} has rank {source.max_rank} > max_lora_rank={max_rank}: restart "
                           f"with --max-lora-rank {source.max_rank} (LoRazorConfig(max_lora_rank={source.max_rank})); "
                           "slots are sized for the largest rank at startup")
    for module, (a_shape, b_shape) in (source.shapes or {}).items():
        check_target(source.name, module, module_sizes)
        rank, _ = module_rank_alpha(source.config, module)
        check_shapes(source.name, module, a_shape, b_shape, rank, *module_sizes[module])
    check_coverage(source, module_sizes)
