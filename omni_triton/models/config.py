"""Qwen3-Omni configuration read from a checkpoint's config.json (+ generation_config.json).

Frozen dataclasses holding only what the serving code uses, named after the released config keys.
The text-model configs keep their original dict in ``raw`` for fields nobody has needed yet; the audio
encoder and Code2Wav configs are the audio modules' own.

Full-size configs ship with the package (``omni_triton/configs/<name>/``): wherever a checkpoint dir is
expected, ``resolve_config_dir`` also takes such a name (``qwen3_omni_30b_a3b``), which is what the ``dummy``
load format (``models.weights``) builds random full-size models from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_triton.models.audio_encoder import AudioEncoderConfig
from omni_triton.models.code2wav.vocoder import Code2WavConfig


SHIPPED_CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
FULL_SIZE_CONFIG = "qwen3_omni_30b_a3b"  # Qwen3-Omni-30B-A3B-Instruct's dimensions


def shipped_config_names() -> list[str]:
    return sorted(p.parent.name for p in SHIPPED_CONFIGS_DIR.glob("*/config.json"))


def resolve_config_dir(checkpoint_or_name: str | Path) -> Path:
    """A dir holding config.json: the path itself if it has one, else the shipped config of that name."""
    path = Path(checkpoint_or_name)
    if (path / "config.json").is_file():
        return path
    shipped = SHIPPED_CONFIGS_DIR / str(checkpoint_or_name)
    if (shipped / "config.json").is_file():
        return shipped
    raise FileNotFoundError(f"no config.json in checkpoint dir {str(checkpoint_or_name)!r}, and it is not a "
                            f"shipped config (one of {shipped_config_names()})")


def write_config_with_layers(source: str | Path, num_layers: int, target: str | Path) -> Path:
    """A copy of ``source``'s config.json (checkpoint dir or shipped name) in ``target`` with the thinker and
    talker cut to at most ``num_layers`` layers each: full-width models that fit a smaller GPU, or a quicker test."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    raw = json.loads((resolve_config_dir(source) / "config.json").read_text())
    for component in ("thinker_config", "talker_config"):
        text = raw[component]["text_config"]
        text["num_hidden_layers"] = min(num_layers, text["num_hidden_layers"])
    raw["talker_config"]["accept_hidden_layer"] = min(raw["talker_config"]["accept_hidden_layer"], num_layers)
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(raw, indent=1) + "\n")
    return target


def _rope(cfg: dict, *, mrope: bool) -> tuple[float, tuple[int, ...] | None]:
    """(theta, mrope_section) from either the v5 ``rope_parameters`` or the released ``rope_scaling`` layout."""
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if not mrope:
        return theta, None
    # transformers' default when the section is absent (the released thinker/talker always set it)
    return theta, tuple(params.get("mrope_section", (24, 20, 20)))


def _require(cfg: dict, key: str, where: str) -> Any:
    if key not in cfg:
        raise ValueError(f"{where}: config.json has no {key!r}")
    return cfg[key]


@dataclass(frozen=True)
class TextModelConfig:
    """A decoder stack: the thinker text model, the talker text model or the code predictor."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...] | None  # None: plain 1-D RoPE (code predictor)
    attention_bias: bool = False
    hidden_act: str = "silu"
    num_experts: int = 0  # 0: dense MLP everywhere
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0  # 0: no shared expert (thinker)
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, cfg: dict, where: str, *, mrope: bool) -> "TextModelConfig":
        hidden = _require(cfg, "hidden_size", where)
        heads = _require(cfg, "num_attention_heads", where)
        theta, section = _rope(cfg, mrope=mrope)
        return cls(
            vocab_size=_require(cfg, "vocab_size", where), hidden_size=hidden,
            intermediate_size=_require(cfg, "intermediate_size", where),
            num_layers=_require(cfg, "num_hidden_layers", where), num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads, rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta, mrope_section=section, attention_bias=cfg.get("attention_bias", False),
            hidden_act=cfg.get("hidden_act", "silu"),
            num_experts=cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0) or 0,
            moe_intermediate_size=cfg.get("moe_intermediate_size", 0) or 0,
            norm_topk_prob=cfg.get("norm_topk_prob", False), decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0) or 0, raw=cfg,
        )

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)


@dataclass(frozen=True)
class ThinkerConfig:
    text: TextModelConfig
    audio: AudioEncoderConfig
    audio_token_id: int
    image_token_id: int
    video_token_id: int
    audio_start_token_id: int | None
    vision_start_token_id: int | None
    position_id_per_seconds: int


@dataclass(frozen=True)
class TalkerConfig:
    text: TextModelConfig
    code_predictor: TextModelConfig
    num_code_groups: int
    thinker_hidden_size: int
    accept_hidden_layer: int
    codec_pad_id: int
    codec_bos_id: int
    codec_eos_token_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    speaker_id: dict[str, int]


@dataclass(frozen=True)
class OmniConfig:
    thinker: ThinkerConfig
    talker: TalkerConfig
    code2wav: Code2WavConfig
    im_start_token_id: int
    im_end_token_id: int
    tts_pad_token_id: int
    tts_bos_token_id: int
    tts_eos_token_id: int
    system_token_id: int
    user_token_id: int
    assistant_token_id: int
    thinker_eos_token_ids: tuple[int, ...]  # generation_config eos ids, else (im_end,)
    enable_audio_output: bool = True

    # Short aliases used throughout the pipeline.
    @property
    def accept_hidden_layer(self) -> int:
        return self.talker.accept_hidden_layer

    @property
    def num_code_groups(self) -> int:
        return self.talker.num_code_groups

    @property
    def speaker_id(self) -> dict[str, int]:
        return self.talker.speaker_id

    def speaker_codec_id(self, speaker: str) -> int:
        try:
            return self.talker.speaker_id[speaker.lower()]
        except KeyError:
            raise ValueError(f"speaker={speaker!r} is not one of {sorted(self.talker.speaker_id)}") from None

    @classmethod
    def from_pretrained(cls, checkpoint_dir: str | Path) -> "OmniConfig":
        checkpoint_dir = Path(checkpoint_dir)
        path = checkpoint_dir / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in checkpoint dir {str(checkpoint_dir)!r}")
        cfg = json.loads(path.read_text())
        generation_path = checkpoint_dir / "generation_config.json"
        generation = json.loads(generation_path.read_text()) if generation_path.is_file() else {}
        return cls.from_dict(cfg, generation)

    @classmethod
    def from_dict(cls, cfg: dict, generation: dict | None = None) -> "OmniConfig":
        thinker_cfg = _require(cfg, "thinker_config", "config")
        talker_cfg = _require(cfg, "talker_config", "config")
        thinker = ThinkerConfig(
            text=TextModelConfig.from_dict(_require(thinker_cfg, "text_config", "thinker_config"),
                                           "thinker_config.text_config", mrope=True),
            audio=AudioEncoderConfig.from_dict(_require(thinker_cfg, "audio_config", "thinker_config")),
            audio_token_id=_require(thinker_cfg, "audio_token_id", "thinker_config"),
            image_token_id=_require(thinker_cfg, "image_token_id", "thinker_config"),
            video_token_id=_require(thinker_cfg, "video_token_id", "thinker_config"),
            audio_start_token_id=thinker_cfg.get("audio_start_token_id"),
            vision_start_token_id=thinker_cfg.get("vision_start_token_id"),
            position_id_per_seconds=thinker_cfg.get("position_id_per_seconds", 25),
        )
        talker = TalkerConfig(
            text=TextModelConfig.from_dict(_require(talker_cfg, "text_config", "talker_config"),
                                           "talker_config.text_config", mrope=True),
            code_predictor=TextModelConfig.from_dict(
                _require(talker_cfg, "code_predictor_config", "talker_config"),
                "talker_config.code_predictor_config", mrope=False),
            num_code_groups=_require(talker_cfg, "num_code_groups", "talker_config"),
            thinker_hidden_size=_require(talker_cfg, "thinker_hidden_size", "talker_config"),
            accept_hidden_layer=_require(talker_cfg, "accept_hidden_layer", "talker_config"),
            **{key: _require(talker_cfg, key, "talker_config") for key in (
                "codec_pad_id", "codec_bos_id", "codec_eos_token_id", "codec_nothink_id",
                "codec_think_bos_id", "codec_think_eos_id")},
            speaker_id={name.lower(): int(i) for name, i in (talker_cfg.get("speaker_id") or {}).items()},
        )
        special = {key: _require(cfg, key, "config") for key in (
            "im_start_token_id", "im_end_token_id", "tts_pad_token_id", "tts_bos_token_id", "tts_eos_token_id",
            "system_token_id", "user_token_id", "assistant_token_id")}
        eos = (generation or {}).get("eos_token_id", special["im_end_token_id"])
        code2wav = Code2WavConfig.from_dict(_require(cfg, "code2wav_config", "config"))
        return cls(thinker=thinker, talker=talker, code2wav=code2wav, **special,
                   thinker_eos_token_ids=tuple(eos) if isinstance(eos, list) else (int(eos),),
                   enable_audio_output=cfg.get("enable_audio_output", True))
