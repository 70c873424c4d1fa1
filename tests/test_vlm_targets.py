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
