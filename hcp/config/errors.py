"""The one error type for bad configuration, raised before any process group starts."""


class ConfigError(ValueError):
    """A config value is invalid.

    The message names the field (dotted key as typed on the CLI), the value and a fix, e.g.
    `llm.layout.tp=3: llm.num_heads=4 is not divisible by it. Fix: use llm.layout.tp in [1, 2]`.
    """

    def __init__(self, field: str, value, problem: str, fix: str):
        self.field, self.value, self.problem, self.fix = field, value, problem, fix
        super().__init__(f"{field}={value!r}: {problem}. Fix: {fix}")


def check_choice(field: str, value, allowed) -> None:
    """Raise ConfigError unless `value` is one of `allowed` (the fix lists them)."""
    if value not in allowed:
        raise ConfigError(field, value, "unknown value", f"use one of {', '.join(allowed)}")
