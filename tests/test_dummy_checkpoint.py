"""Serving a model config with random weights and no checkpoint (`serve --config NAME`): the config-only
checkpoint dir (its tokenizer puts every token the config names at that id), the KV plan of
`--kv-cache-tokens auto` on a GPU, and the launch options that select them. No server here
(tests/test_server_dummy_weights.py serves one)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from omni_triton.checkpoints.dummy import CONFIG_TOKEN_KEYS, build, config_token_ids
from omni_triton.checkpoints.tokenizer import build_tokenizer, with_token_ids
from omni_triton import cli
from omni_triton.launch import serve
from omni_triton.models.config import FULL_SIZE_CONFIG, OmniConfig, write_config_with_layers
from omni_triton.pipeline.chat import ChatTokenizer
from omni_triton.pipeline.preprocess import Preprocessor
from omni_triton.pipeline.request_params import RequestLimits
from omni_triton.pipeline.talker_prompt import ASSISTANT_PREFILL_ROWS, talker_prefill_length
from omni_triton.launch.options import LaunchOptionError, model_source
from omni_triton.launch.memory_plan import GIB, MIN_KV_TOKENS, DoesNotFit, Footprint, plan
from omni_triton.shared.settings import LaunchConfig
from omni_triton.stages.model_args import engine_config, load_options
from omni_triton.stages.stage_io import stage_loading

H200_FREE, H100_FREE = int(139.3 * GIB), int(78.6 * GIB)  # what torch reports free on an idle one


@pytest.fixture(scope="module")
def full_size_dir(tmp_path_factory):
    return build(FULL_SIZE_CONFIG, tmp_path_factory.mktemp("dummy") / FULL_SIZE_CONFIG)


@pytest.fixture(scope="module")
def full_footprint():
    from omni_triton.models.config import resolve_config_dir

    return Footprint.from_checkpoint(resolve_config_dir(FULL_SIZE_CONFIG), torch.bfloat16)


def test_every_token_the_full_config_names_sits_at_its_id(full_size_dir):
    config = json.loads((full_size_dir / "config.json").read_text())
    generation = json.loads((full_size_dir / "generation_config.json").read_text())
    tokenizer = Tokenizer.from_file(str(full_size_dir / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == config["thinker_config"]["text_config"]["vocab_size"] == 152064
    named = config_token_ids(config, generation)
    assert set(named) == set(CONFIG_TOKEN_KEYS) | {"<|endoftext|>"}  # the full config names every one
    for token, token_id in named.items():
        assert tokenizer.token_to_id(token) == token_id, token
        assert tokenizer.encode(token, add_special_tokens=False).ids == [token_id], token
    # the released ids, as the talker, preprocess and the thinker's EOS read them
    omni = OmniConfig.from_pretrained(full_size_dir)
    assert [tokenizer.id_to_token(i) for i in omni.thinker_eos_token_ids] == ["<|im_end|>", "<|endoftext|>"]
    assert (omni.im_start_token_id, omni.user_token_id, omni.assistant_token_id) == (151644, 872, 77091)
    assert [tokenizer.id_to_token(i) for i in (omni.tts_bos_token_id, omni.tts_eos_token_id, omni.tts_pad_token_id)] \
        == ["<tts_text_bos>", "<tts_text_eod>", "<tts_pad>"]
    assert tokenizer.id_to_token(omni.thinker.audio_token_id) == "<|audio_pad|>"
    assert not list(full_size_dir.glob("*.safetensors*")), "a dummy checkpoint dir holds no weights"
    # any id the thinker can sample decodes to text
    assert tokenizer.decode([151999, 100000], skip_special_tokens=True) == " w151999 w100000"


def test_preprocess_builds_talker_ready_prompts_on_the_full_config(full_size_dir):
    preprocessor = Preprocessor(full_size_dir, RequestLimits(), 4096)
    ids = preprocessor({"TEXT": np.array([b"Hello, how are you?"], dtype=object)})["INPUT_IDS"].tolist()
    assert ids[:2] == [151644, 872] and ids[-3:] == [151644, 77091, 198]  # <|im_start|>user ... assistant\n
    assert 151645 in ids  # <|im_end|> closes the user turn
    # every row of the user turn, then the 9 assistant rows (the 3 of "<|im_start|>assistant\n" among them)
    assert talker_prefill_length(ids, preprocessor.roles) == len(ids) - 3 + ASSISTANT_PREFILL_ROWS
    chat = ChatTokenizer.from_checkpoint(full_size_dir)
    spoken = chat.encode_prompt("", num_audio_tokens=7)
    assert spoken.count(151675) == 7 and spoken[spoken.index(151675) - 1] == 151669  # audio_start, 7 pads


def test_the_tiny_config_gets_the_tiny_tokenizer_back(tiny_checkpoint, tmp_path):
    dummy = build(tiny_checkpoint, tmp_path / "tiny")
    prompt = "<|im_start|>user\nTell me a story, please.<|im_end|>\n<|im_start|>assistant\n"
    assert (Tokenizer.from_file(str(dummy / "tokenizer.json")).encode(prompt).ids
            == Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json")).encode(prompt).ids)
    assert build(tiny_checkpoint, tmp_path / "tiny") == dummy  # up to date: kept


def test_renumbering_refuses_two_tokens_at_one_id():
    with pytest.raises(ValueError, match="both pinned at id 7"):
        with_token_ids(build_tokenizer(), {"user": 7, "<|im_start|>": 7}, 1024)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        with_token_ids(build_tokenizer(), {"user": 2000}, 1024)


def test_kv_plan_fills_an_h200_and_names_the_layers_that_fit_an_h100(full_footprint):
    assert 60 * GIB < full_footprint.weight_bytes < 70 * GIB  # ~30.5B thinker + 0.65B audio + 3.3B talker, bf16
    assert (full_footprint.thinker_kv_token_bytes, full_footprint.talker_kv_token_bytes) == (96 << 10, 20 << 10)
    h200 = plan(full_footprint, H200_FREE, code2wav_frames=97, device_name="H200")
    assert h200.thinker_tokens > 300_000 and h200.talker_tokens > 2 * h200.thinker_tokens * 0.9
    used = full_footprint.weight_bytes + h200.reserved_bytes + h200.thinker_kv_bytes + h200.talker_kv_bytes
    assert used <= 0.95 * H200_FREE
    assert "thinker" in h200.describe() and "GiB" in h200.describe()
    with pytest.raises(DoesNotFit, match=r"--dummy-layers (\d+)") as refused:
        plan(full_footprint, H100_FREE, code2wav_frames=97, device_name="H100")
    layers = int(refused.value.args[0].split("--dummy-layers ")[1].split(")")[0])
    cut = plan(full_footprint.with_layers(layers), H100_FREE, code2wav_frames=97)
    assert 30 <= layers < 48 and cut.thinker_tokens >= max(MIN_KV_TOKENS, 16 * 1024)


def test_auto_kv_budget_reaches_each_stage_of_a_cuda_launch(full_size_dir, monkeypatch):
    from omni_triton.launch import memory_plan
    from omni_triton.launch.options import with_kv_budget

    monkeypatch.setattr(memory_plan, "gpu_memory", lambda: {0: (H200_FREE, "H200, 140 GiB")})
    launch = LaunchConfig(checkpoint_dir=full_size_dir, device="cuda", load_format="dummy", left_context_frames=72)
    config, note = with_kv_budget(launch, "auto", 0.95)
    assert 300_000 < config.kv_cache_tokens < config.resolved_talker_kv_cache_tokens
    assert "--kv-cache-tokens auto" in note and f"thinker {config.kv_cache_tokens} tokens" in note
    # as each engine stage reads it back from its config.pbtxt
    stage_settings = LaunchConfig.from_json(config.to_json())
    for stage, tokens in (("thinker", config.kv_cache_tokens), ("talker", config.talker_kv_cache_tokens)):
        engine, _ = engine_config(stage_settings, stage, torch.device("cpu"))
        assert engine.num_blocks == tokens // config.kv_block_size, stage
    _, note = with_kv_budget(launch, 5_000_000, 0.95)  # a number is taken as it is, with a warning
    assert "more than fits" in note


def test_a_model_larger_than_host_memory_is_refused_on_the_cpu(full_size_dir, monkeypatch):
    from omni_triton.launch import memory_plan
    from omni_triton.launch.options import with_kv_budget
    from omni_triton.shared.settings import LaunchConfig

    monkeypatch.setattr(memory_plan, "host_memory_available", lambda: 32 * GIB)
    with pytest.raises(DoesNotFit, match="more than the 32.0 GiB of host memory available: serve this model with "
                                         "--device cuda"):
        with_kv_budget(LaunchConfig(checkpoint_dir=full_size_dir, load_format="dummy"), "auto", 0.95)


def test_cut_footprint_equals_the_cut_config_counted(full_footprint, tmp_path):
    cut = Footprint.from_checkpoint(write_config_with_layers(FULL_SIZE_CONFIG, 30, tmp_path), torch.bfloat16)
    assert cut == full_footprint.with_layers(30)  # 30 thinker layers, the talker's 20 kept


def test_out_of_memory_while_loading_names_the_options():
    with pytest.raises(RuntimeError, match="thinker stage ran out of GPU memory.*--dummy-layers"):
        with stage_loading("thinker"):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")


def serve_args(*argv: str):
    return cli.build_parser().parse_args(["serve", *argv])


def test_config_serves_dummy_weights_with_the_cpu_kv_default(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the dummy dir goes to checkpoints/dummy/<name> under the working dir
    install = type("Install", (), {"interstage_memory": staticmethod(lambda device: "device")})()
    config, note = serve.launch_config(serve_args("--config", str(tiny_checkpoint), "--dummy-seed", "3"), install)
    assert (config.load_format, config.dummy_seed) == ("dummy", 3)
    assert (tmp_path / config.checkpoint_dir).resolve() == (tmp_path / "checkpoints/dummy/tiny").resolve()
    assert config.kv_cache_tokens == config.resolved_talker_kv_cache_tokens == 16384 and "16384" in note
    assert load_options(LaunchConfig.from_json(config.to_json())) == {"load_format": "dummy", "seed": 3}


@pytest.mark.parametrize("argv, message", [
    (["--config", FULL_SIZE_CONFIG, "--checkpoint", "x"], "not both"),
    (["--config", FULL_SIZE_CONFIG, "--load-format", "safetensors"], "needs --checkpoint"),
    (["--dummy-layers", "4"], "cuts a --config"),
    (["--config", "no-such-config"], "shipped config"),
])
def test_launch_options_that_do_not_go_together(argv, message):
    with pytest.raises(LaunchOptionError, match=message):
        model_source(serve_args(*argv))


def test_serve_help_lists_the_new_options_with_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option, default in [("--load-format", "default: safetensors, dummy with --config"),
                            ("--config", "qwen3_omni_30b_a3b"), ("--dummy-seed", "default: 0"),
                            ("--dummy-layers", "default: the config's"), ("--kv-cache-tokens", "default: auto"),
                            ("--gpu-memory-utilization", "default: 0.95"), ("--code2wav-max-batch", "default: 8")]:
        assert option in text and default in text, option


def test_kv_plan_reserves_the_vocoder_states_of_stateful_streams(full_footprint):
    """Stateful chunks: 25-frame calls instead of 603, plus one vocoder state (~2.5 MiB in bf16) per stream slot."""
    assert 2 << 20 < full_footprint.code2wav_stream_bytes < 3 << 20
    exact = plan(full_footprint, H200_FREE, code2wav_frames=603)
    stateful = plan(full_footprint, H200_FREE, code2wav_frames=25, code2wav_streams=128)
    assert stateful.gpus[0].code2wav_activation_bytes == (full_footprint.code2wav_frame_bytes * 25 * 8
                                                          + full_footprint.code2wav_stream_bytes * 128)
    assert stateful.thinker_tokens > exact.thinker_tokens
