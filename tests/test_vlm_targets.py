"""Image-text targets (issue #52, targets): loaded with AutoModelForImageTextToText, vision tower included, planned
with it counted; heads read the language model's decoder layers."""
import pytest
import torch
from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig

from conftest import micro_recipe
from draftsmith import plan
from draftsmith.targets.features import decoder_of
from draftsmith.targets.loading import load_target, load_target_embeddings, model_class


def _qwen25_vl() -> Qwen2_5_VLConfig:
    return Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=600, max_position_embeddings=2048,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, bos_token_id=1, eos_token_id=2),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           fullatt_block_indexes=[1]),
        image_token_id=590, video_token_id=591, vision_start_token_id=592, vision_end_token_id=593)


def test_plan_counts_the_vision_tower():
    config = _qwen25_vl()
    assert model_class(config) is AutoModelForImageTextToText
    with torch.device("meta"):
        whole = AutoModelForImageTextToText.from_config(config)
    vision = sum(p.numel() for n, p in whole.named_parameters() if "visual" in n)
    facts = plan.target_facts(config)
    assert vision > 0 and facts.params == sum(p.numel() for p in whole.parameters())
    assert facts.layers == 4 and facts.hidden == 64 and facts.vocab == 600 and facts.kv_layers == 4


def test_image_text_target_loads_whole_and_heads_read_its_language_model(tmp_path):
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(_qwen25_vl())
    model.save_pretrained(tmp_path / "vlm")
    loaded = load_target(micro_recipe(tmp_path, tmp_path / "vlm"), torch.device("cpu"))
    assert type(loaded).__name__ == "Qwen2_5_VLForConditionalGeneration" and not loaded.training
    assert len(decoder_of(loaded).layers) == 4
    torch.testing.assert_close(loaded.model.visual.patch_embed.proj.weight, model.model.visual.patch_embed.proj.weight)
    embed, lm_head = load_target_embeddings(str(tmp_path / "vlm"))
    assert embed.shape == (600, 64) and torch.equal(embed, model.get_input_embeddings().weight.detach())
    assert torch.equal(lm_head, model.get_output_embeddings().weight.detach())


@pytest.mark.parametrize("config_name", ["Gemma3Config", "Qwen3VLConfig"])
def test_other_image_text_families_load_with_the_same_class(config_name):
    import transformers
    assert model_class(getattr(transformers, config_name)()) is AutoModelForImageTextToText


def _qwen3_vl():
    from transformers import Qwen3VLConfig
    return Qwen3VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=600, max_position_embeddings=2048,
                         rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                           deepstack_visual_indexes=[0, 1], num_position_embeddings=64),
        image_token_id=590, video_token_id=591, vision_start_token_id=592, vision_end_token_id=593)


def _image_prompt(config, patch: int):
    """Text, one image of 4 x 4 patches (4 image tokens after the 2 x 2 merge), text; the inputs its processor would
    give (built by hand: Qwen's processors need torchvision, which this machine's CPU torch cannot run)."""
    g = torch.Generator().manual_seed(0)
    text = lambda n: torch.randint(3, 500, (n,), generator=g)
    image = [config.vision_start_token_id] + [config.image_token_id] * 4 + [config.vision_end_token_id]
    ids = torch.cat([text(5), torch.tensor(image), text(6)])
    return ids, {"pixel_values": torch.randn(16, 3 * 2 * patch * patch, generator=g), "image_grid_thw": torch.tensor([[1, 4, 4]]),
                 "mm_token_type_ids": (ids == config.image_token_id).long()[None]}


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_mrope_targets_decode_image_prompts_exactly(family):
    """Qwen-VL rotates with 3-axis positions (mrope) that the model computes from the image grid; after the prompt,
    text continues at its position plus the model's offset on every axis. Qwen3-VL also adds deepstack visual features
    to its first layers. Plain and speculative decoding (trees, rounds rejected, partial and whole) equal `generate`."""
    from test_layer_types import CyclingDrafter
    from draftsmith.runtime.generate import plain_generate, speculative_generate
    from draftsmith.runtime.target import TargetRunner
    from draftsmith.runtime.validate import generate_reference
    from draftsmith.runtime.verify import SamplingConfig
    config, patch = (_qwen25_vl(), 14) if family == "qwen2_5_vl" else (_qwen3_vl(), 16)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).eval()
    model.generation_config.eos_token_id = None
    ids, image = _image_prompt(config, patch)
    runner = TargetRunner(model, 64, [1, 3], compile_mode=None)
    logits, _, _ = runner.prefill(ids, image)
    with torch.no_grad():
        torch.testing.assert_close(logits, model(input_ids=ids[None], **image).logits[0, -1:].float(), atol=1e-4, rtol=1e-4)
    assert runner.rope_offset < 0  # the image's tokens share positions: text after it continues below its index
    reference = generate_reference(model, ids, 16, set(), image)[0]
    assert plain_generate(runner, ids, 16, SamplingConfig(), set(), image_inputs=image).tokens == reference
    spec = speculative_generate(runner, CyclingDrafter(reference, len(ids), 3, 600, width=2), ids, 16, SamplingConfig(),
                                set(), image_inputs=image)
    assert spec.tokens == reference and {0, 3} <= set(spec.accept_lengths)
    runner.reset()
    runner.prefill(ids, image)
    offset, runner.rope_offset = runner.rope_offset, 0  # without the offset the next token rotates wrongly
    one = torch.ones(1, 1, dtype=torch.bool)
    wrong = runner.forward(ids[-1:], torch.zeros(1, dtype=torch.long), one)[0]
    runner.truncate(len(ids))
    runner.rope_offset = offset
    right = runner.forward(ids[-1:], torch.zeros(1, dtype=torch.long), one)[0]
    assert not torch.allclose(wrong, right, atol=1e-4)


@pytest.mark.parametrize("recipe_path,model,first_id", [
    ("recipes/qwen2.5-vl-7b-instruct/eagle3.yaml", "Qwen/Qwen2.5-VL-7B-Instruct", 2),
    ("recipes/qwen3-vl-8b-instruct/eagle3.yaml", "Qwen/Qwen3-VL-8B-Instruct", 4)])
def test_vlm_recipes_fit_their_launch_and_read_layers_every_engine_agrees_on(recipe_path, model, first_id):
    """The Qwen-VL recipes plan with the vision tower counted and fit 8 x 80 GB; their layer ids start above the
    layers Qwen3-VL adds deepstack features to (SGLang reads those before the add, HF after); the draft they export
    drafts on plain 1D positions (no mrope section)."""
    from pathlib import Path
    from conftest import target_config
    from draftsmith import recipe as recipe_mod
    from draftsmith.heads.eagle3.model import draft_config_from_target
    root = Path(__file__).resolve().parent.parent
    recipe, config = recipe_mod.load(root / recipe_path), target_config(model)
    assert model_class(config) is AutoModelForImageTextToText
    out = plan.make_plan(recipe, config, 8, 80)
    assert all(row["fits"] for row in out["stages"].values()), out["stages"]
    facts = plan.target_facts(config)
    with torch.device("meta"):
        vision = sum(p.numel() for n, p in AutoModelForImageTextToText.from_config(config).named_parameters() if "visual" in n)
    assert vision > 3e8 and facts.params > 8e9
    ids = recipe.capture.layer_ids
    deepstack = len(getattr(config.vision_config, "deepstack_visual_indexes", None) or [])
    assert ids[0] == first_id and ids[0] > deepstack and ids == sorted(ids) and ids[-1] < facts.layers
    draft = draft_config_from_target(config, recipe.head.draft_vocab_size, ids)
    assert draft["rope_scaling"] is None and draft["hidden_size"] == config.get_text_config().hidden_size
    text = (root / recipe_path).read_text()
    assert "--gpu-memory-gb 80" in text and f"{facts.params / 1e9:.1f}B parameters" in text
