"""The exceptions users catch, in a module that imports nothing of the package: settings modules,
selectors and baselines raise them without importing each other."""


class LocksConfigError(ValueError):
    """A `LocksConfig` field has a value the method cannot run with."""


class BudgetDoesNotFit(LocksConfigError):
    """The method's fixed token blocks do not fit in the budget (e.g. ShadowKV below 424 tokens):
    a sweep reports such an arm as not run."""


class UnsupportedModelError(ValueError):
    """The model (or one attention call) uses a feature Locks' sparse decode cannot reproduce exactly."""
