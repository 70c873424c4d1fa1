"""Recipes: every shipped recipe loads; bad keys, types and values are named clearly."""
from pathlib import Path

import pytest

from draftsmith import recipe as recipe_mod
from draftsmith.recipe import RecipeError

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted((ROOT / "recipes").rglob("*.yaml"))
TRAINING_RECIPES = [p for p in RECIPES if "launch" not in p.parts]


@pytest.mark.parametrize("path", TRAINING_RECIPES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_recipe_loads(path):
    recipe = recipe_mod.load(path)
    from draftsmith.heads.registry import head_spec
    suffix = path.stem.split("-")[-1]  # the kind; Medusa recipes say which variant: medusa1 or medusa2 (joint LoRA)
    kind = "medusa" if suffix in ("medusa1", "medusa2") else suffix
    assert recipe.name and head_spec(recipe.head.kind).kind == recipe.head.kind == kind
    assert (recipe.head.lora is not None) == (suffix == "medusa2")
    if recipe.head.lora is not None:
        assert recipe.capture.mode == "online"
    assert recipe_mod.loads(recipe_mod.dump(recipe)).to_dict() == recipe.to_dict()  # resolved form round-trips


@pytest.mark.parametrize("path", [p for p in RECIPES if "launch" in p.parts], ids=lambda p: p.name)
def test_launch_configs_are_accelerate_configs(path):
    import yaml
    config = yaml.safe_load(path.read_text())
    assert config["distributed_type"] in {"MULTI_GPU", "FSDP", "DEEPSPEED", "MULTI_CPU", "NO"}
    assert "num_processes" in config


def test_real_target_layer_ids_follow_reference():
    """EAGLE-3 defaults {2, N//2, N-3} in the input-to-layer convention."""
    expected = {"llama-3.1-8b-instruct": (32, [2, 16, 29]), "llama-3.3-70b-instruct": (80, [2, 40, 77]),
                "qwen3-8b": (36, [2, 18, 33]), "smollm2-135m-instruct": (30, [2, 15, 27])}
    for folder, (num_layers, ids) in expected.items():
        recipe = recipe_mod.load(ROOT / "recipes" / folder / "eagle3.yaml")
        assert recipe.capture.layer_ids == ids == [2, num_layers // 2, num_layers - 3]


def test_unknown_key_names_path_and_valid_keys():
    with pytest.raises(RecipeError) as err:
        recipe_mod.loads("name: x\ntarget: {model: m}\ntrain: {learning_rate: 1.0}")
    assert "train.learning_rate" in str(err.value) and "lr" in str(err.value)


def test_nested_unknown_key():
    with pytest.raises(RecipeError, match=r"train\.tracking\.projekt"):
        recipe_mod.loads("name: x\ntarget: {model: m}\ntrain: {tracking: {projekt: p}}")


def test_wrong_type_names_key_value_and_type():
    with pytest.raises(RecipeError) as err:
        recipe_mod.loads("name: x\ntarget: {model: m}\ntrain: {batch_size: many}")
    assert "train.batch_size" in str(err.value) and "'many'" in str(err.value) and "int" in str(err.value)


def test_bad_choice_lists_valid_values():
    with pytest.raises(RecipeError, match=r"capture\.dtype.*'fp8'"):
        recipe_mod.loads("name: x\ntarget: {model: m}\ncapture: {dtype: int4}")


def test_overrides_parse_yaml_values():
    recipe = recipe_mod.loads("name: x\ntarget: {model: m}", ["train.lr=2e-4", "capture.layer_ids=[1, 2, 3]",
                                                             "head.ttt_steps=3", "data.system_prompt=Be brief."])
    assert recipe.train.lr == 2e-4 and recipe.capture.layer_ids == [1, 2, 3]
    assert recipe.head.ttt_steps == 3 and recipe.data.system_prompt == "Be brief."


def test_override_of_unknown_key_is_rejected():
    with pytest.raises(RecipeError, match="train.lrr"):
        recipe_mod.loads("name: x\ntarget: {model: m}", ["train.lrr=1"])


def test_missing_file_and_missing_name():
    with pytest.raises(RecipeError, match="does not exist"):
        recipe_mod.load("recipes/nope.yaml")
    with pytest.raises(RecipeError, match="'name' is required"):
        recipe_mod.loads("target: {model: m}")


def test_section_hash_changes_only_with_its_sections():
    a = recipe_mod.loads("name: x\ntarget: {model: m}")
    b = recipe_mod.loads("name: x\ntarget: {model: m}", ["train.lr=1.0"])
    assert a.section_hash("data", "capture") == b.section_hash("data", "capture")
    assert a.section_hash("train") != b.section_hash("train")


def test_gguf_targets_are_named_by_one_string():
    """`target.gguf_file` folds into `target.model` (one id for manifests and fingerprints); misuse is named."""
    base = "name: x\ntarget:\n  model: org/repo\n"
    folded = recipe_mod.loads(base + "  gguf_file: model.Q4_K_M.gguf\n")
    assert folded.target.model == "org/repo/model.Q4_K_M.gguf" and folded.target.gguf_file is None
    with pytest.raises(RecipeError, match="target.gguf_file='weights.bin'.*expected a .gguf file name"):
        recipe_mod.loads(base + "  gguf_file: weights.bin\n")
    with pytest.raises(RecipeError, match="target.gguf_file"):
        recipe_mod.loads("name: x\ntarget:\n  model: a/b/c.gguf\n  gguf_file: c.gguf\n")


def test_validate_prompts_take_one_file_or_several_sets():
    one = recipe_mod.loads("name: x\ntarget: {model: m}\nvalidate: {prompts: p.jsonl}\n")
    assert one.validate.prompts == "p.jsonl"
    several = recipe_mod.loads('name: x\ntarget: {model: m}\nvalidate:\n  prompts:\n    - {path: "builtin:humaneval"}\n'
                               "    - {path: q.jsonl, domain: chat}\n")
    assert [(s.path, s.domain, s.split) for s in several.validate.prompts] == [("builtin:humaneval", None, "test"),
                                                                                ("q.jsonl", "chat", "test")]
    with pytest.raises(RecipeError, match=r"validate.prompts\[0\]"):
        recipe_mod.loads("name: x\ntarget: {model: m}\nvalidate:\n  prompts:\n    - {file: q.jsonl}\n")
