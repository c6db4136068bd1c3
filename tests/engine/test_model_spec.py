"""Model spec from HF configs, every supported rotary scaling reproduced exactly, clear errors otherwise."""
import pytest
import torch
from support.tiny_models import save_tiny_model, tiny_config, tiny_model

from inferscale_core.encoder import capture_pre_rope
from inferscale_core.model_spec import ModelSpec, UnsupportedModelError
from inferscale_core.models import load_model
from inferscale_core.rope import ChunkedRope

SCALINGS = {
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
}


def test_smollm2_spec(smollm2):
    spec = ModelSpec.from_config(smollm2[0].config)
    assert (spec.architecture, spec.num_layers, spec.num_kv_heads, spec.head_dim) == ("llama", 30, 3, 64)
    assert (spec.rotary_dim, spec.rope_type, spec.rope_theta, spec.has_k_norm) == (64, "default", 100000.0, False)
    assert spec.kv_bytes(10, torch.bfloat16) == 2 * 30 * 10 * 3 * 64 * 2


def test_qwen3_keys_pass_a_norm():
    assert ModelSpec.from_config(tiny_config("qwen3")).has_k_norm
    assert not ModelSpec.from_config(tiny_config("qwen2")).has_k_norm


@pytest.mark.parametrize("scaling", list(SCALINGS))
@torch.no_grad()
def test_rope_scaling_types_reproduce_model_keys(scaling):
    model = tiny_model("llama", rope_parameters=SCALINGS[scaling])
    assert ModelSpec.from_config(model.config).rope_type == scaling
    ids = torch.randint(0, 1000, (1, 40))
    positions = (torch.arange(40) * 25 + 3)[None]  # up to ~1000: beyond yarn's original context
    with capture_pre_rope(model) as (keys, _):
        out = model(input_ids=ids, position_ids=positions, use_cache=True)
    rope = ChunkedRope(model.config)
    for layer, k_pre in enumerate(keys):
        expected = out.past_key_values.layers[layer].keys[0].transpose(0, 1)
        assert (rope.rotate(k_pre[0], positions[0]) - expected).abs().max().item() < 1e-5


def test_dynamic_rope_refuses_positions_where_it_is_not_static():
    rope = ChunkedRope(tiny_config("llama", rope_parameters=SCALINGS["dynamic"], max_position_embeddings=256))
    with pytest.raises(ValueError, match="dynamic RoPE"):
        rope.rotate(torch.zeros(2, 2, 16), torch.tensor([10, 300]))


def test_unsupported_models_are_named():
    from transformers import GPT2Config

    with pytest.raises(UnsupportedModelError, match="gpt2"):
        ModelSpec.from_config(GPT2Config())
    with pytest.raises(UnsupportedModelError, match="longrope"):
        ModelSpec.from_config(tiny_config("llama", rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                                                   "short_factor": [1.0] * 8,
                                                                   "long_factor": [1.0] * 8}))


def test_qwen2_head_dim_must_follow_from_hidden_size():
    from support.tiny_models import tiny_config

    ModelSpec.from_config(tiny_config("qwen2", hidden_size=256, head_dim=64))  # 256 / 4 heads = 64
    with pytest.raises(UnsupportedModelError, match=r"qwen2 with head_dim 64 != hidden_size / num_attention_heads"):
        ModelSpec.from_config(tiny_config("qwen2", hidden_size=64, head_dim=64))
    ModelSpec.from_config(tiny_config("llama", hidden_size=64, head_dim=64))  # vLLM's Llama reads head_dim


def test_any_local_model_folder_loads(tmp_path, smollm2_path):
    folder = save_tiny_model("qwen3", tmp_path / "qwen3", tokenizer_from=smollm2_path)
    model, tok = load_model(folder)
    assert ModelSpec.from_config(model.config).architecture == "qwen3" and tok is not None
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "nowhere")
