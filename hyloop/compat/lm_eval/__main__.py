"""``python -m hyloop.compat.lm_eval run --model hyloop --model_args pretrained=... --tasks ...``"""

from __future__ import annotations

import hyloop.compat.lm_eval.model  # noqa: F401  registers "hyloop"


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
