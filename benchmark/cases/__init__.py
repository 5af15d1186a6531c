"""Every day's benchmark cases. A new day adds a module here and lists it in CASES."""

from . import day009

CASES = [*day009.CASES]
