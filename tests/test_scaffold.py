"""`draftsmith init`: a commented recipe from the target's config alone, which loads and runs as written."""
import json

import pytest
import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from draftsmith import recipe as recipe_mod
from draftsmith.cli import main
from draftsmith.scaffold import init_recipe

QWEN3_THINKING = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}" \
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and " \
                 "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"


def _config_dir(tmp_path, arch: str, template: str | None = None, **extra):
    """A config.json (and, with `template`, a tokenizer_config.json) alone: what `init --config` reads offline."""
    folder = tmp_path / arch
    folder.mkdir(parents=True)
    AutoConfig.for_model(arch, vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, eos_token_id=151645,
                         pad_token_id=151643, **extra).save_pretrained(folder)
    if template:
        (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return folder


def test_init_from_a_config_alone(tmp_path):
    """A Qwen3-8B-shaped config offline: EAGLE-3 layer ids [2, 18, 33] (SGLang's minus one noted), thinking on as
    served, a 32000-token draft vocabulary, a layout that fits, a GPU tree, launch lines; it loads as a recipe."""
    folder = _config_dir(tmp_path, "qwen3", QWEN3_THINKING)
    text = init_recipe("Qwen/Qwen3-8B", "eagle3", str(folder / "config.json"), gpus=8, gpu_memory_gb=80)
    recipe = recipe_mod.loads(text)
    assert recipe.capture.layer_ids == [2, 18, 33] and "[1, 17, 32]" in text
    assert recipe.data.chat_template_kwargs == {"enable_thinking": True} and recipe.data.regen.enabled
    assert recipe.head.draft_vocab_size == 32000 and recipe.target.model == "Qwen/Qwen3-8B"
    assert (recipe.target.parallel.tp, recipe.validate.top_k, recipe.validate.num_nodes) == (1, 10, 60)
    assert "accelerate launch --config_file recipes/launch/zero2.yaml train_eagle3.py" in text
    assert [s.path for s in recipe.validate.prompts] == ["builtin:humaneval", "builtin:math", "builtin:chat"]
    assert all(len(line) <= 120 for line in text.splitlines())
    plain = init_recipe("Qwen/Qwen3-8B", "dflash", str(_config_dir(tmp_path / "p", "qwen3", "{{ messages }}")))
    loaded = recipe_mod.loads(plain)
    assert loaded.data.chat_template_kwargs == {} and loaded.head.kind == "dflash" and loaded.head.draft_vocab_size is None
    assert loaded.capture.layer_ids == [2, 10, 18, 26, 34]  # z-lab's spread, input-to-layer


def test_init_sizes_the_layout_and_chains_recurrent_targets(tmp_path):
    big = _config_dir(tmp_path / "b", "llama", None)
    config = json.loads((big / "config.json").read_text()) | {"num_hidden_layers": 80, "hidden_size": 8192,
                                                                 "intermediate_size": 28672, "num_attention_heads": 64}
    (big / "config.json").write_text(json.dumps(config))
    recipe = recipe_mod.loads(init_recipe("meta-llama/Llama-3.3-70B-Instruct", "eagle3", str(big / "config.json"),
                                          gpus=8, gpu_memory_gb=80))
    assert recipe.target.parallel.tp * recipe.target.parallel.pp >= 2  # 140 GB of weights do not fit one device
    hybrid = _config_dir(tmp_path / "h", "qwen3_next", None, num_experts=4, num_experts_per_tok=2,
                         layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 9)
    chain = recipe_mod.loads(init_recipe("Qwen/Qwen3-Next-80B-A3B-Instruct", "eagle3", str(hybrid / "config.json")))
    assert chain.validate.top_k == 1


def test_init_cli_writes_once_and_names_bad_input(tmp_path, capsys):
    folder = _config_dir(tmp_path, "qwen3", None)
    out = tmp_path / "recipes" / "mine.yaml"
    assert main(["init", "--target", "Qwen/Qwen3-8B", "--kind", "eagle3", "--config", str(folder), "--out", str(out)]) == 0
    assert recipe_mod.load(out).head.kind == "eagle3" and "wrote" in capsys.readouterr().out
    assert main(["init", "--target", "Qwen/Qwen3-8B", "--kind", "eagle3", "--config", str(folder), "--out", str(out)]) == 2
    assert "exists" in capsys.readouterr().err
    assert main(["init", "--target", "Qwen/Qwen3-8B", "--kind", "eagle4", "--config", str(folder)]) == 2
    assert "valid kinds: dflash, eagle2, eagle3, medusa, mtp, peagle" in capsys.readouterr().err


@pytest.mark.long
@pytest.mark.parametrize("arch", ["embedded", "qwen3"])
def test_init_then_run_with_no_edits(tmp_path, micro_target, arch):
    """The recipe init writes runs as written (a short budget given on the command line, the file untouched), on the
    embedded target and on a tiny Qwen3."""
    from draftsmith.stages import run_all
    target = micro_target
    if arch == "qwen3":
        tokenizer = AutoTokenizer.from_pretrained(micro_target)
        config = AutoConfig.for_model("qwen3", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(0)
        target = tmp_path / "qwen3"
        AutoModelForCausalLM.from_config(config).save_pretrained(target)
        tokenizer.save_pretrained(target)
    path = tmp_path / "init.yaml"
    assert main(["init", "--target", str(target), "--kind", "eagle3", "--out", str(path)]) == 0
    written = path.read_text()
    budget = [f"out_dir={tmp_path / 'runs'}", "data.max_length=192", "data.regen.max_new_tokens=8",
              'data.sources=[{path: "builtin:code", max_records: 12}, {path: "builtin:math", max_records: 6}]',
              "data.heldout_fraction=0.0", "train.max_steps=3", "train.tracking.backend=none", "validate.num_prompts=3",
              "validate.max_new_tokens=8", "capture.batch_tokens=2048"]
    summary = run_all(recipe_mod.load(path, budget))
    assert "greedy exact: True" in summary and path.read_text() == written
    assert yaml.safe_load(written)["capture"]["layer_ids"] == ([2, 3, 4] if arch == "qwen3" else [2, 4, 5])  # [2, N//2, N-3]


def test_init_refuses_a_target_that_fits_no_layout(tmp_path):
    folder = _config_dir(tmp_path, "llama", None)
    config = json.loads((folder / "config.json").read_text()) | {"num_hidden_layers": 80, "hidden_size": 8192,
                                                                    "intermediate_size": 28672, "num_attention_heads": 64}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"init: .*fits no layout of 1 x 24 GB; give more --gpus"):
        init_recipe("meta-llama/Llama-3.3-70B-Instruct", "eagle3", str(folder / "config.json"), gpus=1, gpu_memory_gb=24)


def test_init_for_an_image_text_target_reads_layers_every_engine_agrees_on(tmp_path):
    """Qwen3-VL-8B's config offline: the lowest EAGLE-3 id moves above the 3 layers its vision tower adds deepstack
    features to ([4, 18, 33], not [2, 18, 33]); Qwen2.5-VL, without deepstack, keeps EAGLE-3's ids; the header says
    how to give image data."""
    from conftest import target_config
    for model, expected in (("Qwen/Qwen3-VL-8B-Instruct", [4, 18, 33]), ("Qwen/Qwen2.5-VL-7B-Instruct", [2, 14, 25])):
        folder = tmp_path / model.split("/")[1]
        target_config(model).save_pretrained(folder)
        text = init_recipe(model, "eagle3", str(folder / "config.json"), gpus=8, gpu_memory_gb=80)
        assert recipe_mod.loads(text).capture.layer_ids == expected
        assert "An image-text target" in text and ("deepstack" in text) == (expected[0] == 4)
        assert all(len(line) <= 120 for line in text.splitlines())
