"""The one exception type the hub resolvers raise for user-facing failures."""
from __future__ import annotations

from twinkle_core.errors import UserError


class HubError(UserError):
    """A model or dataset id could not be resolved; the message names the id and the fix."""


class HubUnreachable(HubError):
    """The hub could not be reached while online: worth retrying, unlike a wrong id."""
