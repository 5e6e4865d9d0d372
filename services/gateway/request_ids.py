"""A client's X-Request-Id is used only once: a reused id would mix two requests' token
streams and break the records' batch."""

from __future__ import annotations

import collections
import logging

from aiohttp import web

from services.gateway.httputil import new_request_id
from shared.db.records import RecordWriter
from shared.db.schema import RequestRecord
from shared.db.session import sessionmaker

log = logging.getLogger(__name__)
RECENT_IDS = 65536  # request ids remembered here, so a client's X-Request-Id is never reused


class RequestIds:
    def __init__(self, records: RecordWriter | None, remembered: int = RECENT_IDS) -> None:
        self.records = records  # None: no SQL (tests); this gateway's memory only
        self.remembered = remembered
        self._recent: collections.OrderedDict[str, None] = collections.OrderedDict()

    async def settle(self, request: web.Request) -> str:
        """The client's X-Request-Id when it is valid (httputil checked its form) and not
        one this gateway or SQL has seen; otherwise a fresh one."""
        rid: str = request["request_id"]
        if not request.get("client_request_id"):
            return rid
        taken = rid in self._recent
        if not taken and self.records is not None:
            async with sessionmaker(self.records.engine)() as s:
                taken = await s.get(RequestRecord, rid) is not None
        if not taken:
            return rid
        fresh = new_request_id(request.path)
        log.info("request %s: X-Request-Id %s was used before; serving it as %s", fresh, rid, fresh)
        request["request_id"] = fresh
        return fresh

    def remember(self, request_id: str) -> None:
        self._recent[request_id] = None
        while len(self._recent) > self.remembered:
            self._recent.popitem(last=False)
