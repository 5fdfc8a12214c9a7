"""Bearer tokens for HTTP, and the identity a workspace is bound to.

Each configured token is its own principal: a workspace opened with one token is invisible to the
others. Over stdio, or HTTP with --no-auth, there is no principal and workspaces are shared.
"""

from __future__ import annotations

import hashlib
import hmac

from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.auth.provider import AccessToken, TokenVerifier


def principal(token: str) -> str:
    # a digest, so the raw token is never kept beside the workspaces or logged
    return "client-" + hashlib.sha256(token.encode()).hexdigest()[:16]


class StaticTokenVerifier(TokenVerifier):
    def __init__(self, tokens: list[str]):
        self._tokens = [(t.encode(), principal(t)) for t in tokens]

    async def verify_token(self, token: str) -> AccessToken | None:
        given = token.encode()
        match = None
        for expected, client_id in self._tokens:
            # compare against every token, in constant time, so timing says nothing about which
            if hmac.compare_digest(expected, given):
                match = client_id
        if match is None:
            return None
        return AccessToken(token=token, client_id=match, scopes=[])


def current_owner() -> str | None:
    """The principal of the request being handled (None when unauthenticated)."""
    token = get_access_token()
    return token.client_id if token is not None else None
