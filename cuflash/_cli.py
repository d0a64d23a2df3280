"""What every ``python -m cuflash...`` entry point does around its ``main``."""
from __future__ import annotations

import os
import sys
from typing import Callable, NoReturn


def exit_with(main: Callable[[], int]) -> NoReturn:
    """``sys.exit(main())``, where a reader that stops reading early (``python -m cuflash | head -1``) ends the
    command quietly, status 1, instead of a BrokenPipeError traceback (Python's own advice: stdout goes to
    /dev/null, so that the interpreter's last flush does not raise again)."""
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    sys.exit(code)
