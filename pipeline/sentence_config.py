"""What a sentence-transformers directory does beyond its transformer, read from its own files.

`SentenceTransformer(dir).encode` pools the token states as `1_Pooling/config.json` says (CLS for
BGE models, mean for MiniLM, ...), L2-normalizes only where `modules.json` lists a Normalize
module, cuts texts at `sentence_bert_config.json`'s `max_seq_length` and lowercases them where it
says `do_lower_case`; TEI reads the same files. The export builds the pooling into the graph, the
stored tokenizer lowercases, and the recipe's `text.max_length` may not pass that cut, so that the
service answers as sentence-transformers does. A plain Hugging Face directory (no `modules.json`)
is mean-pooled and normalized.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict
from tokenizers import Tokenizer, normalizers

PoolingMode = Literal["mean", "cls", "max", "lasttoken", "mean_sqrt_len_tokens", "weightedmean"]
MODULES_FILE = "modules.json"
SETTINGS_FILE = "sentence_bert_config.json"
PROMPTS_FILE = "config_sentence_transformers.json"
# sentence-transformers before 6 wrote one boolean per mode.
LEGACY_POOLING_KEYS: dict[str, PoolingMode] = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


class SentenceConfigError(ValueError):
    """A directory whose sentence-transformers modules the export cannot reproduce; names the file."""


class SentencePooling(BaseModel):
    """From token states to one vector per text: the pooling mode, then L2 normalization or not."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    mode: PoolingMode = "mean"
    normalize: bool = True


class SentenceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    pooling: SentencePooling = SentencePooling()
    max_seq_length: int | None = None  # where sentence-transformers cuts a text, in tokens
    do_lower_case: bool = False  # sentence-transformers lowercases texts before its tokenizer


def _read_json(path: Path) -> dict | list:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SentenceConfigError(f"cannot read {path}: {exc}") from exc


def _pooling_mode(path: Path) -> PoolingMode:
    """Both formats: `pooling_mode` (sentence-transformers 6) or a `pooling_mode_*` boolean per mode."""
    config = _read_json(path)
    mode = config.get("pooling_mode")
    if mode is None:
        modes = [m for key, m in LEGACY_POOLING_KEYS.items() if config.get(key)]
        mode = modes[0] if len(modes) == 1 else modes or "mean"
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if isinstance(mode, list):
        raise SentenceConfigError(f"{path}: pooling modes {mode} concatenated: only one mode is supported")
    if mode not in get_args(PoolingMode):
        raise SentenceConfigError(f"{path}: unknown pooling mode {mode!r} (known: {', '.join(get_args(PoolingMode))})")
    if config.get("include_prompt") is False:
        raise SentenceConfigError(f"{path}: include_prompt false (pooling without the prompt) is not supported")
    return mode


def read_sentence_config(model_dir: Path) -> SentenceConfig:
    """The directory's pooling, normalization and length; refuses modules the export would drop
    (a Dense projection, say) rather than serve vectors sentence-transformers would not give."""
    modules_path = model_dir / MODULES_FILE
    settings_path = model_dir / SETTINGS_FILE
    prompts_path = model_dir / PROMPTS_FILE
    prompt = _read_json(prompts_path).get("default_prompt_name") if prompts_path.is_file() else None
    if prompt:
        raise SentenceConfigError(
            f"{prompts_path}: default_prompt_name {prompt!r}: sentence-transformers puts that prompt before every "
            "text, the service embeds texts as they are sent; remove it, and let clients send the prompt"
        )
    settings = _read_json(settings_path) if settings_path.is_file() else {}
    length = {"max_seq_length": settings.get("max_seq_length"), "do_lower_case": settings.get("do_lower_case", False)}
    if not modules_path.is_file():
        return SentenceConfig(**length)
    modules = _read_json(modules_path)
    kinds = [str(module.get("type", "")).rsplit(".", 1)[-1] for module in modules]
    if kinds[:1] != ["Transformer"] or modules[0].get("path", "") not in ("", "."):
        raise SentenceConfigError(
            f"{modules_path}: the first module must be a Transformer stored in the directory itself, not {modules[0]}"
        )
    unsupported = [kind for kind in kinds[1:] if kind not in ("Pooling", "Normalize")]
    if unsupported or kinds.count("Pooling") != 1 or kinds.count("Normalize") > 1:
        raise SentenceConfigError(
            f"{modules_path}: modules {kinds}: only Transformer, Pooling and an optional Normalize are supported"
        )
    pooling_dir = model_dir / modules[kinds.index("Pooling")].get("path", "")
    mode = _pooling_mode(pooling_dir / "config.json")
    if "Normalize" in kinds and kinds.index("Normalize") < kinds.index("Pooling"):
        raise SentenceConfigError(f"{modules_path}: Normalize before Pooling is not supported")
    pooling = SentencePooling(mode=mode, normalize="Normalize" in kinds)
    return SentenceConfig(pooling=pooling, **length)


def lowercasing_tokenizer(tokenizer_file: Path, path: Path) -> Path:
    """The tokenizer with a Lowercase normalizer first, as sentence-transformers sets up a
    `do_lower_case` model's: stored in its place, it lowercases in the service too."""
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    steps = [normalizers.Lowercase()] + ([tokenizer.normalizer] if tokenizer.normalizer is not None else [])
    tokenizer.normalizer = normalizers.Sequence(steps)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path
