"""The one error type for bad configuration, raised before any process group starts."""


class ConfigError(ValueError):
    """A config value is invalid.

    The message names the field (dotted key as typed on the CLI), the value and a fix, e.g.
    `llm.layout.tp=3: llm.num_heads=4 is not divisible by it. Fix: use llm.layout.tp in [1, 2]`.
    `candidates`, when given, are the values of `field` the fix offers, and `fix` holds `{values}`
    where their list goes: `hcp.config.validate.validate` then offers only those that pass every
    rule (`narrowed`).
    """

    def __init__(self, field: str, value, problem: str, fix: str, candidates=None):
        self.field, self.value, self.problem = field, value, problem
        self.candidates, self.fix_template = candidates, fix
        self.fix = fix.replace("{values}", str(list(candidates))) if candidates is not None else fix
        super().__init__(f"{field}={value!r}: {problem}. Fix: {self.fix}")

    def narrowed(self, passing: list, blocked: "ConfigError | None" = None) -> "ConfigError":
        """This error offering only `passing` of its candidates; when none passes, a fix that
        says so and names the rule `blocked` (the first candidate's error) instead."""
        if passing:
            return ConfigError(self.field, self.value, self.problem, self.fix_template, passing)
        because = f" ({blocked.field}={blocked.value!r}: {blocked.problem})" if blocked else ""
        return ConfigError(self.field, self.value, self.problem,
                           f"no single value of {self.field} in "
                           f"{list(self.candidates)} passes every rule with the other settings as "
                           f"they are{because}; change another setting too")


def check_choice(field: str, value, allowed) -> None:
    """Raise ConfigError unless `value` is one of `allowed` (the fix lists them)."""
    if value not in allowed:
        raise ConfigError(field, value, "unknown value", f"use one of {', '.join(allowed)}")
