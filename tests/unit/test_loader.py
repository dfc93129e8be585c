"""Loading a Hugging Face Llama-family directory, and the errors for anything else."""

import json

import pytest
import torch
from dpserve_shared.schema import EngineRequest, SamplingParams

from dpserve_engine.core import EngineCore
from dpserve_engine.loader import load_hf_dir
from dpserve_engine.model import ModelArgs, Precision, build_model
from dpserve_engine.model_files import ModelFilesNotFound, resolve_model_path
from dpserve_engine.model_info import load_model_info
from dpserve_engine.settings import EngineConfig

pytestmark = pytest.mark.timeout(60)
ARGS = ModelArgs(vocab_size=260, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=128, tie_embeddings=False)


def hf_state(args: ModelArgs) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    hd, state = args.head_dim, {}
    rand = lambda *shape: torch.randn(*shape, generator=g) / shape[-1] ** 0.5  # noqa: E731
    state["model.embed_tokens.weight"] = rand(args.vocab_size, args.dim)
    state["lm_head.weight"] = rand(args.vocab_size, args.dim)
    state["model.norm.weight"] = torch.ones(args.dim)
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        state[p + "self_attn.q_proj.weight"] = rand(args.n_heads * hd, args.dim)
        state[p + "self_attn.k_proj.weight"] = rand(args.n_kv_heads * hd, args.dim)
        state[p + "self_attn.v_proj.weight"] = rand(args.n_kv_heads * hd, args.dim)
        state[p + "self_attn.o_proj.weight"] = rand(args.dim, args.n_heads * hd)
        state[p + "mlp.gate_proj.weight"] = rand(args.ffn_dim, args.dim)
        state[p + "mlp.up_proj.weight"] = rand(args.ffn_dim, args.dim)
        state[p + "mlp.down_proj.weight"] = rand(args.dim, args.ffn_dim)
        state[p + "input_layernorm.weight"] = torch.ones(args.dim)
        state[p + "post_attention_layernorm.weight"] = torch.ones(args.dim)
    return state


@pytest.fixture
def hf_dir(tmp_path):
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    state = hf_state(ARGS)
    save_file(state, str(tmp_path / "model.safetensors"))
    config = {
        "model_type": "llama", "vocab_size": ARGS.vocab_size, "hidden_size": ARGS.dim,
        "num_hidden_layers": ARGS.n_layers, "num_attention_heads": ARGS.n_heads,
        "num_key_value_heads": ARGS.n_kv_heads, "intermediate_size": ARGS.ffn_dim, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 128, "tie_word_embeddings": False, "eos_token_id": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    vocab = {chr(i) if i < 256 else f"<s{i}>": i for i in range(ARGS.vocab_size)}  # byte-level-ish toy vocab
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    return tmp_path, state


def test_hf_directory_loads_and_generates_like_the_in_memory_model(hf_dir):
    path, state = hf_dir
    args, loaded = load_hf_dir(str(path))
    assert args == ARGS
    config = EngineConfig(model=str(path), device="cpu", dtype="float32", num_kv_blocks=64, block_size=4)
    info = load_model_info(config)
    assert info.max_model_len == 128 and info.eos_token_ids == [2] and info.chat_template
    from_dir = EngineCore(config)
    in_memory = EngineCore.from_model(config, build_model(ARGS, state, Precision.fp32(), torch.device("cpu")), info)
    outs = []
    for core in (from_dir, in_memory):
        core.add_request(EngineRequest("r", [5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)))
        tokens = []
        while core.has_unfinished():
            tokens += [t for o in core.step() for t in o.new_token_ids]
        outs.append(tokens)
    assert outs[0] == outs[1] and len(outs[0]) == 6


def test_missing_files_are_named(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelFilesNotFound, match=r"tokenizer\.json.*safetensors"):
        resolve_model_path(str(tmp_path))
    with pytest.raises(ModelFilesNotFound, match="not found"):
        resolve_model_path(str(tmp_path / "nope"))


def test_a_tensor_the_model_does_not_read_is_an_error_naming_it():
    state = hf_state(ARGS)
    state["model.layers.0.self_attn.q_norm.weight"] = torch.ones(ARGS.head_dim)  # Qwen3's q norm: not computed here
    with pytest.raises(ValueError, match=r"does not use 1 of the checkpoint's tensors.*self_attn\.q_norm\.weight"):
        build_model(ARGS, state, Precision.fp32(), torch.device("cpu"))


def test_a_directory_of_a_family_the_model_does_not_compute_is_refused_at_load(hf_dir):
    path, _ = hf_dir
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(config, model_type="qwen3")))
    with pytest.raises(ValueError, match="model_type 'qwen3'.*not supported"):
        load_hf_dir(str(path))
    (path / "config.json").write_text(json.dumps(dict(config, rope_parameters={"rope_type": "llama3", "factor": 8.0})))
    with pytest.raises(ValueError, match="rope_parameters of type 'llama3'"):
        load_hf_dir(str(path))


def _tiny_gguf(path, extra_tensors=(), **metadata):
    """A llama GGUF of ARGS' shape in F32 (names and layout as llama.cpp writes them) with extra tensors/keys."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_embedding_length(ARGS.dim)
    writer.add_block_count(ARGS.n_layers)
    writer.add_head_count(ARGS.n_heads)
    writer.add_head_count_kv(ARGS.n_kv_heads)
    writer.add_feed_forward_length(ARGS.ffn_dim)
    writer.add_context_length(ARGS.max_seq_len)
    for key, value in metadata.items():
        writer.add_uint32(key, value) if isinstance(value, int) else writer.add_string(key, value)
    names = {"token_embd.weight": (ARGS.vocab_size, ARGS.dim), "output_norm.weight": (ARGS.dim,)}
    for i in range(ARGS.n_layers):
        for kind, shape in (("attn_norm", (ARGS.dim,)), ("attn_q", (ARGS.dim, ARGS.dim)),
                            ("attn_k", (ARGS.n_kv_heads * ARGS.head_dim, ARGS.dim)),
                            ("attn_v", (ARGS.n_kv_heads * ARGS.head_dim, ARGS.dim)),
                            ("attn_output", (ARGS.dim, ARGS.dim)), ("ffn_norm", (ARGS.dim,)),
                            ("ffn_gate", (ARGS.ffn_dim, ARGS.dim)), ("ffn_up", (ARGS.ffn_dim, ARGS.dim)),
                            ("ffn_down", (ARGS.dim, ARGS.ffn_dim))):  # fmt: skip
            names[f"blk.{i}.{kind}.weight"] = shape
    names.update(dict(extra_tensors))
    for name, shape in names.items():
        writer.add_tensor(name, np.zeros(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_a_llama_gguf_loads_and_its_unknowns_are_errors_naming_them(tmp_path):
    from dpserve_engine.loader import load_gguf

    args, state = load_gguf(_tiny_gguf(tmp_path / "plain.gguf"))
    assert (args.dim, args.n_layers, args.tie_embeddings) == (ARGS.dim, ARGS.n_layers, True)
    assert "model.layers.1.mlp.down_proj.weight" in state
    with pytest.raises(ValueError, match=r"rope_freqs\.weight \(llama3 rope scaling\) is not supported"):
        load_gguf(_tiny_gguf(tmp_path / "llama3.gguf", [("rope_freqs.weight", (ARGS.head_dim // 2,))]))
    with pytest.raises(ValueError, match=r"GGUF tensor 'blk\.0\.attn_q_norm\.weight' is not one the llama model reads"):
        load_gguf(_tiny_gguf(tmp_path / "qnorm.gguf", [("blk.0.attn_q_norm.weight", (ARGS.head_dim,))]))
    with pytest.raises(ValueError, match=r"rope\.dimension_count 4 is not the head size 8"):
        load_gguf(_tiny_gguf(tmp_path / "partial.gguf", **{"llama.rope.dimension_count": 4}))


def test_a_gguf_of_another_architecture_is_refused_by_name_before_anything_is_read(tmp_path):
    import gguf
    import numpy as np

    from dpserve_engine.loader import load_gguf
    from dpserve_engine.model_info import model_info_from_gguf

    path = str(tmp_path / "qwen3.gguf")
    writer = gguf.GGUFWriter(path, "qwen3")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="GGUF architecture 'qwen3' is not supported"):
        model_info_from_gguf(path, EngineConfig(model=path))
    with pytest.raises(ValueError, match="GGUF architecture 'qwen3' is not supported"):
        load_gguf(path)
