"""Today's targets through the parts of the pipeline that read them, on tiny random models built from
transformers' own configs: windowed and sink attention (gpt-oss, Gemma 2/3, Mistral, OLMo 3, EXAONE 4),
chunked attention and MoE (Llama 4), linear attention and state-space layers (Qwen3-Next, Qwen3.5,
Falcon-H1, Nemotron-H, LFM2), fused experts (GLM-4.5, MiniMax-M2): features and heads here, the runtime in
test_layer_types.py, the whole pipeline in test_other_architectures.py."""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from draftsmith.heads.eagle3.model import Eagle3Head, draft_config_from_target
from draftsmith.targets.features import FeatureExtractor, decoder_of

BASE = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, head_dim=16)
ARCHITECTURES = {
    "llama4_text": dict(intermediate_size_mlp=64, num_local_experts=2, num_experts_per_tok=1),
    "gpt_oss": dict(num_local_experts=2, num_experts_per_tok=1, sliding_window=4),
    "gemma2": dict(sliding_window=4), "gemma3_text": dict(sliding_window=4), "mistral": dict(sliding_window=4),
    "olmo3": dict(sliding_window=4), "exaone4": dict(sliding_window=4), "cohere2": dict(sliding_window=4),
    "qwen3_next": dict(num_experts=2, num_experts_per_tok=1, linear_num_value_heads=4, linear_num_key_heads=2),
    "qwen3_5_text": dict(linear_num_value_heads=4, linear_num_key_heads=2), "falcon_h1": {}, "lfm2": {},
    "nemotron_h": dict(hybrid_override_pattern="M*M-M*", n_routed_experts=2, num_experts_per_tok=1),
    "glm4_moe": dict(n_routed_experts=2, num_experts_per_tok=1, first_k_dense_replace=1),
    "minimax_m2": dict(num_local_experts=2, num_experts_per_tok=1), "qwen3_moe": dict(num_experts=2, num_experts_per_tok=1),
}


def tiny(model_type: str):
    config = AutoConfig.for_model(model_type, **{**BASE, **ARCHITECTURES[model_type]})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_features_are_the_models_own_hidden_states(model_type):
    """The extractor's hooks find the decoder layers wherever the architecture keeps them and return exactly
    the model's own `hidden_states` (input-to-layer ids) and its final normed state."""
    model = tiny(model_type)
    ids = torch.randint(0, 128, (2, 14), generator=torch.Generator().manual_seed(1))
    layer_ids = [1, 3, 5]
    aux, final = FeatureExtractor(model, layer_ids)(ids, torch.ones_like(ids))
    with torch.no_grad():
        states = model(input_ids=ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(aux, torch.cat([states[k] for k in layer_ids], dim=-1))
    torch.testing.assert_close(final, states[-1])
    assert len(decoder_of(model).layers) == BASE["num_hidden_layers"]


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_an_eagle3_head_builds_for_every_target(model_type):
    config = tiny(model_type).config
    head = Eagle3Head(draft_config_from_target(config, 64, [1, 3, 5]))
    assert head.fc.in_features == 3 * BASE["hidden_size"] and head.config["draftsmith"]["target_model_type"] == model_type
