"""Errors that mean "the user asked for something that cannot work".

They carry a one-line message that names the problem and the fix; the
command line prints that line alone, without a traceback.
"""


class UserError(ValueError):
    """Bad input: a recipe, a config value, a data source, a tokenizer."""
