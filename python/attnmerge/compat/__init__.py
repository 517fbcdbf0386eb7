"""Drop-in layers that keep other libraries' signatures and conventions exactly."""
import re


def renamed(error, names):
    """`error` again, with the native argument names in its message replaced by `names`' values."""
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
    return type(error)(pattern.sub(lambda m: names[m.group(1)], str(error)))
