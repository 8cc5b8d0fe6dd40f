"""Stream one request to the `omni` model: prints text as it arrives, writes out.wav, prints TTFT/TTFA/RTF.

    python client/stream_client.py "Hello, how are you today?" --url 127.0.0.1:8001 --out out.wav
    python client/stream_client.py --audio-in question.wav --speaker chelsie

The client is omni_triton.client (also behind `omni-triton demo`); this script runs it from a checkout.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from omni_triton.client import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
