"""Silences one misleading transformers warning while a Qwen3-Omni config is built.

Qwen3-Omni's talker keeps its multimodal-rotary keys (``mrope_section``, ``interleaved``, ``mrope_interleaved``)
in ``rope_parameters``, as the released checkpoints do. transformers (checked up to 5.23) lets the thinker's
text config declare those keys (``Qwen3OmniMoeTextConfig.ignore_keys_at_rope_validation``) but not the talker's
text config (``Qwen3OmniMoeTalkerTextConfig``), so building any Qwen3-Omni config logs "Unrecognized keys in
`rope_parameters` for 'rope_type'='default': {...}", although the talker reads exactly those keys. The upstream
fix is the same class attribute on the talker text config; until a release has it, the warning is dropped here
for those three keys only (any other unrecognised key still warns).

Switch: ``OMNI_TRITON_SHOW_ROPE_KEY_WARNING=1`` lets the warning through. Delete this module once transformers'
talker text config declares the keys.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

MROPE_KEYS = ("mrope_section", "interleaved", "mrope_interleaved")
SWITCH = "OMNI_TRITON_SHOW_ROPE_KEY_WARNING"
_LOGGER = "transformers.modeling_rope_utils"


class _MropeKeyWarningFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith("Unrecognized keys in `rope_parameters`"):
            return True
        named = message.rsplit(":", 1)[-1]
        keys = {key.strip(" '{}\"") for key in named.split(",")}
        return not keys <= set(MROPE_KEYS)


@contextlib.contextmanager
def quiet_mrope_key_warning() -> Iterator[None]:
    """Within the block, transformers' warning about the talker's mrope keys is not logged."""
    if os.environ.get(SWITCH) == "1":
        yield
        return
    logger, quiet = logging.getLogger(_LOGGER), _MropeKeyWarningFilter()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)
