"""IPython startup file of `make gpu-settings`: the notebooks take the settings a GPU gets.

``attnbook.on_gpu()`` is what every notebook asks before it trains longer on a GPU; here it says
True while ``attnbook.device()`` stays the CPU, so the longer trainings run (slowly) on the CPU and
every assert is checked with them, without a GPU.
"""

import attnbook
import attnbook.utils


def _on_gpu() -> bool:
    return True


attnbook.on_gpu = attnbook.utils.on_gpu = _on_gpu
