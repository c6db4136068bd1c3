"""A small Python client of `inferscale.v1.Memory`.

    with MemoryClient("localhost:9000") as c:
        c.add_facts("alice", ["likes green tea", "has a dog named Rex"])
        for piece in c.answer("alice", "What is my dog called?"):
            print(piece.text, end="")

Errors arrive as grpc.RpcError with the server's status code and a message naming the field at fault.
`token` (a JWT; `inferscale token USER` prints one for a local server) is sent on every call as the metadata
`authorization: Bearer <token>`. Against Ray Serve, `application` selects the Serve application (metadata
"application"); it is only needed when several applications run. For a server behind TLS pass
`credentials=grpc.ssl_channel_credentials(...)`.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc

from .api import pb2, pb2_grpc


class MemoryClient:
    def __init__(self, target: str = "localhost:9000", application: str | None = None, timeout_s: float = 60.0,
                 channel: grpc.Channel | None = None, token: str | None = None,
                 credentials: grpc.ChannelCredentials | None = None):
        if channel is None:
            channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
        self.channel = channel
        self.stub = pb2_grpc.MemoryStub(self.channel)
        self.metadata = ((("application", application),) if application else ()) + (
            (("authorization", f"Bearer {token}"),) if token else ())
        self.timeout_s = timeout_s

    def _kw(self) -> dict:
        return {"metadata": self.metadata, "timeout": self.timeout_s}

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "MemoryClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- writes
    def add_facts(self, user_id: str, texts: Sequence[str], metadata: dict | None = None,
                  windows: Sequence[Sequence[str]] | None = None) -> list:
        windows = windows or [[] for _ in texts]
        facts = [pb2.FactInput(text=t, metadata=metadata or {}, window=list(w)) for t, w in zip(texts, windows)]
        return list(self.stub.AddFacts(pb2.AddFactsRequest(user_id=user_id, facts=facts), **self._kw()).facts)

    def add_memory(self, user_id: str, messages: Sequence[dict], infer: bool = True,
                   metadata: dict | None = None) -> list:
        req = pb2.AddMemoryRequest(user_id=user_id, infer=infer, metadata=metadata or {},
                                   messages=[pb2.Message(role=m["role"], content=m["content"]) for m in messages])
        return list(self.stub.AddMemory(req, **self._kw()).results)

    def update(self, user_id: str, fact_id: str, text: str | None = None, metadata: dict | None = None,
               expected_version: int = 0):
        req = pb2.UpdateMemoryRequest(user_id=user_id, fact_id=fact_id, metadata=metadata or {},
                                      expected_version=expected_version)
        if text is not None:
            req.text = text
        return self.stub.UpdateMemory(req, **self._kw())

    def delete(self, user_id: str, fact_id: str) -> None:
        self.stub.DeleteMemory(pb2.DeleteMemoryRequest(user_id=user_id, fact_id=fact_id), **self._kw())

    def delete_user(self, user_id: str) -> int:
        return self.stub.DeleteUser(pb2.DeleteUserRequest(user_id=user_id), **self._kw()).deleted

    # ---- reads
    def get(self, user_id: str, fact_id: str):
        return self.stub.GetMemory(pb2.GetMemoryRequest(user_id=user_id, fact_id=fact_id), **self._kw())

    def list(self, user_id: str, page_size: int = 0) -> Iterator:
        """Every fact of the user, page by page."""
        token = ""
        while True:
            page = self.stub.ListMemories(pb2.ListMemoriesRequest(user_id=user_id, page_size=page_size,
                                                                  page_token=token), **self._kw())
            yield from page.facts
            if not page.next_page_token:
                return
            token = page.next_page_token

    def search(self, user_id: str, query: str, k: int = 0) -> list:
        return list(self.stub.Search(pb2.SearchRequest(user_id=user_id, query=query, k=k), **self._kw()).hits)

    def answer(self, user_id: str, query: str, k: int = 0, max_tokens: int = 0, temperature: float = 0.0,
               mode: str = "") -> Iterator:
        """Yields AnswerChunk messages; the last has final=True with ttft_ms and fact_ids."""
        req = pb2.AnswerRequest(user_id=user_id, query=query, k=k, max_tokens=max_tokens, temperature=temperature,
                                mode=mode)
        yield from self.stub.Answer(req, **self._kw())

    def health(self):
        return self.stub.Health(pb2.HealthRequest(), **self._kw())
