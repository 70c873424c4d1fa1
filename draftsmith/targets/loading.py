"""The frozen target: load any Hugging Face causal LM (a model directory, a Hub id, or a GGUF file through
targets/gguf.py) and its tokenizer, identify it by content (fingerprint), and load it partially
(embedding/lm_head alone, or only the first and last decoder layers) by reading just the needed tensors
from its safetensors files."""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch

from draftsmith.recipe import Recipe
from draftsmith.targets import gguf
from draftsmith.targets.features import Skip, decoder_of

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is bf16 on CUDA (speed) and fp32 on CPU (exactness)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def target_fingerprint(model: str) -> str:
    """Cheap identity of a model directory: its config plus, per weight file, the size and a hash of
    sampled 64 KiB blocks (so a retrained target differs, without reading 100 GB of weights). A single file
    (GGUF) is fingerprinted the same way."""
    path = gguf.local_file(model) if gguf.is_gguf(model) and gguf.is_local(model) else Path(model)
    if path.is_file():
        return _sampled_digest(hashlib.sha256(), [path]).hexdigest()[:16]
    if not path.is_dir():
        return hashlib.sha256(model.encode()).hexdigest()[:16]
    digest = hashlib.sha256((path / "config.json").read_bytes() if (path / "config.json").exists() else b"")
    return _sampled_digest(digest, sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin"))).hexdigest()[:16]


def _sampled_digest(digest, files: list[Path]):
    for weight in files:
        size = weight.stat().st_size
        digest.update(f"{weight.name}:{size}".encode())
        with open(weight, "rb") as handle:
            for k in range(16):
                handle.seek(size * k // 16)
                digest.update(handle.read(1 << 16))
    return digest


def local_model(model: str, dtype: str = "auto") -> str:
    """What transformers loads the target from: `target.model` itself, or for a GGUF file its dequantized
    copy (fp32 for `auto`: the exact dequantized values; converted once, targets/gguf.py)."""
    if not gguf.is_gguf(model):
        return model
    check_model_path(model)
    return str(gguf.convert(model, "fp32" if dtype == "auto" else dtype, target_fingerprint(model)))


def target_config(model: str):
    """The target's config: from the model directory or Hub, or from a GGUF file's metadata alone."""
    from transformers import AutoConfig
    check_model_path(model)
    return gguf.read_config(model) if gguf.is_gguf(model) else AutoConfig.from_pretrained(model)


def check_model_path(model: str, key: str = "target.model") -> None:
    looks_local = model.startswith((".", "/", "runs")) or Path(model).exists()
    if gguf.is_gguf(model):
        if gguf.is_local(model):
            gguf.local_file(model)  # names a missing file or package
        else:
            check_hub_model(gguf.location(model)[0], key)
        return
    if looks_local and not (Path(model) / "config.json").exists():
        raise ValueError(f"{key}={model!r}: no model directory with a config.json there "
                         f"(for the embedded default run `draftsmith target --recipe ...` first)")
    if not looks_local:
        check_hub_model(model, key)


@functools.lru_cache(maxsize=None)
def check_hub_model(model: str, key: str = "target.model") -> None:
    """A hub id that cannot be fetched stops the stage within seconds, in one line that says what to do,
    instead of a library traceback after a minute of retries. With the Hub out of reach, a cached copy is
    used offline."""
    import os
    import socket
    from urllib.parse import urlparse
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
    cached = isinstance(try_to_load_from_cache(model, "config.json"), str)
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
        if cached:
            return
        raise ValueError(f"{key}={model!r}: HF_HUB_OFFLINE is set and no cached copy exists; download it where there "
                         f"is network (`hf download {model}`) and point {key} at that directory")
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=5).close()
    except OSError:
        if cached:
            os.environ["HF_HUB_OFFLINE"] = "1"  # transformers then reads the cache without retrying the Hub
            print(f"{key}={model!r}: the Hub is out of reach; using the cached copy", flush=True)
            return
        raise ValueError(f"{key}={model!r} cannot be fetched: {endpoint.hostname} is out of reach and there is no cached "
                         f"copy; download it where there is network (`hf download {model}`) and point {key} at that "
                         "local directory") from None
    try:
        hf_hub_download(model, "config.json", etag_timeout=10)
    except GatedRepoError:
        raise ValueError(f"{key}={model!r} is a gated repository: accept its license on its Hub page, then log in "
                         "(`hf auth login`) or set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ValueError(f"{key}={model!r}: no such repository on the Hub (mistyped, or private: set HF_TOKEN) and no "
                         "local directory of that name") from None


def load_tokenizer(recipe: Recipe):
    from transformers import AutoTokenizer
    check_model_path(recipe.target.model)
    source = local_model(recipe.target.model, recipe.target.dtype)
    tokenizer = AutoTokenizer.from_pretrained(source)
    # an image-text target's processor expands each image into its image tokens; it travels with the tokenizer,
    # and its chat template (which renders image parts) is the target's when the tokenizer has none
    tokenizer.draftsmith_processor = load_processor(source)
    if tokenizer.draftsmith_processor is not None and not tokenizer.chat_template:
        tokenizer.chat_template = tokenizer.draftsmith_processor.chat_template
    if recipe.target.chat_template:
        tokenizer.chat_template = recipe.target.chat_template
    tokenizer.draftsmith_template_kwargs = dict(recipe.data.chat_template_kwargs)
    return tokenizer


def is_image_text(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def load_processor(model: str):
    """An image-text target's own `AutoProcessor` (image processor and tokenizer), with the id of the token the model
    puts image features on (its config's, which a processor's `image_token_id` is not always: Gemma 3's names the
    begin-of-image marker); None for a text target."""
    config = None if gguf.is_gguf(model) else target_config(model)
    if config is None or not is_image_text(config):
        return None
    from transformers import AutoProcessor
    try:
        processor = AutoProcessor.from_pretrained(model)
        processor.draftsmith_image_token_id = next(
            (v for v in (getattr(config, k, None) for k in ("image_token_id", "image_token_index")) if v is not None), None)
        return processor
    except (ImportError, AttributeError, OSError, ValueError) as exc:  # e.g. a video processor that needs torchvision
        raise ValueError(f"target.model={model!r} is an image-text model, and its processor does not load here "
                         f"({type(exc).__name__}: {str(exc)[:200]}); install what it names (Qwen2.5-VL and Qwen3-VL "
                         "processors need torchvision)") from None


def model_class(config):
    """The auto class a target loads with: `AutoModelForImageTextToText` for an image-text model (a config with a
    vision tower: Qwen2.5-VL, Qwen3-VL, Gemma 3, LLaVA), so that its weights, vision tower included, load as
    published; `AutoModelForCausalLM` otherwise. Heads read the language model's decoder layers either way."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    return AutoModelForImageTextToText if is_image_text(config) else AutoModelForCausalLM


def load_target(recipe: Recipe, device: torch.device | None = None, layout=None, stage: str = "validate"):
    """Any AutoModelForCausalLM, frozen, in eval mode, with the model's own default attention (SDPA where it
    has it, eager for models such as gpt-oss and Gemma 2 that implement sinks or soft-capping there), or
    `target.attn_implementation`. With a sharded `layout`
    (targets/parallel.py) transformers shards it at load time over the launch's process group, each
    rank reading only its shard; the layout is checked against the config first (and, by the stage,
    against the device's memory: plan.check_before_loading), so a layout that cannot work fails before
    any weight is read."""
    from draftsmith.targets import parallel
    check_model_path(recipe.target.model)
    device = device or pick_device()
    dtype = resolve_dtype(recipe.target.dtype, device)
    source = local_model(recipe.target.model, recipe.target.dtype)
    auto = model_class(target_config(source))
    if layout is None or not layout.sharded:
        model = auto.from_pretrained(source, dtype=dtype, attn_implementation=recipe.target.attn_implementation)
        model.requires_grad_(False)
        return model.eval().to(device)
    parallel.check_config(layout, target_config(recipe.target.model))
    parallel.init_process_group()
    model = auto.from_pretrained(source, dtype=dtype, attn_implementation=recipe.target.attn_implementation,
                                 distributed_config=layout.distributed_config())
    model.requires_grad_(False)
    return model.eval()


def _empty_target(model_dir: str):
    """(config, the architecture with parameters on the meta device and buffers such as rotary
    tables real): parameter names and module layout without reading any weight."""
    from accelerate import init_empty_weights
    config = target_config(model_dir)
    with init_empty_weights(include_buffers=False):
        model = model_class(config).from_config(config)
    return config, model


def _weight_name(model, module) -> str:
    return next(f"{name}.weight" for name, m in model.named_modules() if m is module)


def _read_weights(model_dir: str, names: set[str], why: str, optional: set[str] = frozenset()) -> dict[str, torch.Tensor]:
    """The named tensors from the model's safetensors files, nothing else; a missing one is an error
    (except `optional` ones, e.g. a tied lm_head)."""
    from safetensors import safe_open
    found = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in names.intersection(handle.keys()):
                found[name] = handle.get_tensor(name)
    missing = sorted(names - set(found) - set(optional))
    if missing:
        raise ValueError(f"{model_dir}: weight files lack {missing[:4]}{' ...' if len(missing) > 4 else ''} ({why})")
    return found


def _tied(config) -> bool:
    return bool(getattr(config.get_text_config(), "tie_word_embeddings", False))


def load_target_embeddings(model: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(input embedding, lm_head) weights alone, read from the weight files without loading the model.
    Names come from the architecture itself, so this works for any causal LM with safetensors
    weights (a GGUF target: its dequantized copy); a tied head returns the embedding twice."""
    model_dir = local_model(model)
    config, model = _empty_target(model_dir)
    embed, head = _weight_name(model, model.get_input_embeddings()), _weight_name(model, model.get_output_embeddings())
    if embed not in _names_on_disk(model_dir):  # renamed while loading (Nemotron-H's backbone.): transformers' own load
        whole = model_class(target_config(model_dir)).from_pretrained(model_dir)
        return whole.get_input_embeddings().weight.detach(), whole.get_output_embeddings().weight.detach()
    found = _read_weights(model_dir, {embed, head}, "needed for the head's embedding and teacher",
                          optional={head} if _tied(config) else set())
    return found[embed], found.get(head, found[embed])


def _names_on_disk(model_dir: str) -> set[str]:
    from safetensors import safe_open
    names = set()
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            names.update(handle.keys())
    return names


def _without_layers(model_class, skip: range):
    """The model's own class, built with decoder layers `skip` replaced by pass-through stand-ins, so that
    `from_pretrained` loads (and converts) the other layers only."""
    def __init__(self, config, *args, **kwargs):
        model_class.__init__(self, config, *args, **kwargs)
        layers = decoder_of(self).layers
        for i in skip:
            layers[i] = Skip.for_decoder(decoder_of(self), layers[i])
    return type(model_class.__name__, (model_class,), {"__init__": __init__, "__module__": model_class.__module__})


def load_target_layers(recipe: Recipe, device: torch.device, skip: range):
    """The target with decoder layers `skip` never loaded (pass-through stand-ins), frozen: what the
    trainer needs to rebuild the features a compact capture store leaves out. Only the kept weights
    are read from the safetensors files, so a 70B target costs a few layers of memory.

    Checkpoints whose tensors transformers renames or converts while loading (fused MoE experts: one
    `experts.gate_up_proj` in memory from per-expert tensors on disk, in glm4_moe, minimax_m2,
    qwen3_moe, qwen3_next, deepseek_v3, gpt_oss, llama4; Nemotron-H's `backbone.` names) go through
    `from_pretrained`, which owns those conversions, on the model's own class with the skipped layers
    already stand-ins: their tensors match no parameter, so they are never converted nor kept."""
    source = local_model(recipe.target.model, recipe.target.dtype)
    config, model = _empty_target(source)
    layers = decoder_of(model).layers
    for i in skip:
        layers[i] = Skip.for_decoder(decoder_of(model), layers[i])
    head = _weight_name(model, model.get_output_embeddings())
    wanted = {name for name, _ in model.named_parameters(remove_duplicate=False)} - ({head} if _tied(config) else set())
    dtype = resolve_dtype(recipe.target.dtype, device)
    converted = sorted(wanted - _names_on_disk(source))
    if converted:
        import transformers
        print(f"target.model={recipe.target.model!r}: its tensors are renamed or converted while loading "
              f"({converted[0]} ...); loading {len(layers) - len(skip)} of {len(layers)} layers through transformers' "
              "own conversions", flush=True)
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()  # the skipped layers' tensors are "not used", by design
        try:
            model, info = _without_layers(type(model), skip).from_pretrained(source, dtype=dtype,
                                                                               output_loading_info=True)
        finally:
            transformers.logging.set_verbosity(verbosity)
        lacking = sorted(set(info.get("missing_keys", ())) & wanted)  # genuinely absent, not renamed: never initialised at random
        if lacking:
            raise ValueError(f"{recipe.target.model}: weight files lack {lacking[:4]}{' ...' if len(lacking) > 4 else ''} "
                             "(needed to rebuild features at train time; capture with capture.recompute: false instead)")
        model.requires_grad_(False)
        return model.eval().to(device)
    state = _read_weights(source, wanted, "needed to rebuild features at train time; "
                          "capture with capture.recompute: false instead")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if _tied(config):
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    model.requires_grad_(False)
    return model.eval().to(device)
