"""Render the model_repository/ templates into a runnable Triton model repository.

Each template's config.pbtxt holds ``${name}`` placeholders (string.Template) for what Triton itself reads
(batch sizes, instance groups, tensor shapes) and one ``settings`` parameter: the whole launch settings object
as JSON (``LaunchConfig.to_json``), which every stage stub reads back with the same class
(``omni_triton.stages.model_args.launch_settings``). Every model.py and other file is copied as-is. With
``--pipelines N`` the pipeline stages' templates (thinker, talker, code2wav) are rendered once per pipeline, as
``thinker_p0`` ... (``placement.pipeline_model``), each with its pipeline's GPUs in its instance_group; the
orchestrator once, with an instance group per pipeline (``Placement.instance_group``).
"""

from __future__ import annotations

import json
import re
import shutil
import string
from dataclasses import replace
from pathlib import Path

from omni_triton.shared.placement import GPU_STAGES, pipeline_model
from omni_triton.shared.settings import LaunchConfig

TEMPLATE_DIR = Path(__file__).resolve().parents[2] / "model_repository"


def template_values(config: LaunchConfig, model: str, pipeline: int = 0) -> dict[str, str]:
    """The ${...} values of one model's config.pbtxt (in ``pipeline``): what Triton itself reads (its name, batch
    sizes, instances, tensor shapes and types), and ``settings``: the launch settings as JSON, which the stage
    reads back whole."""
    checkpoint = Path(config.checkpoint_dir).resolve()
    engine = Path(config.code2wav_engine_path).resolve() if config.code2wav_engine_path else None
    settings = replace(config, checkpoint_dir=checkpoint, code2wav_engine_path=engine)
    values = dict(
        settings=_pbtxt_string(settings.to_json()),
        model_name=pipeline_model(model, pipeline, config.placement.pipelines),
        instance_group=config.placement.instance_group(model, config.device, pipeline) if model in GPU_STAGES else "",
        # inter-stage states (thinker embeddings/hidden) travel in the engines' dtype
        state_data_type={"float32": "TYPE_FP32", "bfloat16": "TYPE_BF16", "float16": "TYPE_FP16"}[
            config.resolved_dtype],
        code_groups=_checkpoint_code_groups(checkpoint),
        max_inflight_requests=config.max_inflight_requests,
        code2wav_max_batch=config.code2wav_max_batch,
    )
    return {k: str(v) for k, v in values.items()}


def _pbtxt_string(text: str) -> str:
    """``text`` inside a protobuf text-format string literal (JSON's quotes and backslashes escaped)."""
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _checkpoint_code_groups(checkpoint: Path) -> int:
    config_path = checkpoint / "config.json"
    try:
        return int(json.loads(config_path.read_text())["talker_config"]["num_code_groups"])
    except (OSError, KeyError, ValueError) as error:
        raise ValueError(f"checkpoint {checkpoint}: cannot read talker_config.num_code_groups "
                         f"from {config_path}: {error}") from None


def available_models(template_dir: Path = TEMPLATE_DIR) -> list[str]:
    return sorted(p.name for p in Path(template_dir).iterdir() if (p / "config.pbtxt").is_file())


def render_repository(config: LaunchConfig, out_dir: str | Path, models: list[str] | None = None,
                      template_dir: str | Path = TEMPLATE_DIR) -> Path:
    """Write the rendered repository to ``out_dir`` (replacing it) and return it."""
    template_dir, out_dir = Path(template_dir), Path(out_dir)
    models = available_models(template_dir) if models is None else list(models)
    missing = [m for m in models if not (template_dir / m / "config.pbtxt").is_file()]
    if missing:
        raise ValueError(f"no model template for {missing} in {template_dir} "
                         f"(have {available_models(template_dir)})")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    rendered_models = []
    for model in models:
        source, text = template_dir / model, (template_dir / model / "config.pbtxt").read_text()
        for pipeline in config.placement.pipelines_of(model):
            values = template_values(config, model, pipeline)
            target = out_dir / values["model_name"]
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "config.pbtxt"))
            try:
                rendered = string.Template(text).substitute(values)
            except (KeyError, ValueError) as error:
                raise ValueError(f"{source / 'config.pbtxt'}: unknown or malformed placeholder {error}") from None
            (target / "config.pbtxt").write_text(rendered)
            rendered_models.append(values["model_name"])
    _check_ensemble_steps(out_dir, rendered_models)
    return out_dir


def _check_ensemble_steps(out_dir: Path, models: list[str]) -> None:
    """An ensemble whose step model is absent would only fail inside tritonserver's log: fail here."""
    for model in models:
        text = (out_dir / model / "config.pbtxt").read_text()
        if 'platform: "ensemble"' not in text:
            continue
        steps = set(re.findall(r'model_name:\s*"([^"]+)"', text))
        absent = sorted(steps - set(models))
        if absent:
            raise ValueError(f"ensemble {model!r} needs models {absent}, which are not rendered")
