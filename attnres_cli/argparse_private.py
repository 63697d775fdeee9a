"""The command's reach into argparse's private parts: the help formatter's hook for an option's help text, which its
documentation names only as a class to choose, and a parser's list of actions, which it has no public reader for."""

import argparse

from attnres.requirements import require


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Ends an option's help with its default, unless it has none or the help already says what it is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, [], argparse.SUPPRESS) or "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


require(hasattr(argparse.ArgumentDefaultsHelpFormatter, "_get_help_string"), argparse, "HelpFormatter._get_help_string")
require(hasattr(argparse.ArgumentParser(), "_actions"), argparse, "ArgumentParser._actions")


def option_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's actions, one per option, to change how they are shown."""
    return parser._actions
