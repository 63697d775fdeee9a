"""A stand-in for the Hugging Face Hub on 127.0.0.1: just enough of its API for `HfApi.create_repo` + `upload_folder`
(and transformers' `push_to_hub`), recording what was uploaded. See research/ecosystem.md §7 for the endpoints.

    with HubStub() as hub:
        env = {"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": "hf_fake"}   # for a subprocess; or HfApi(endpoint=hub.endpoint)
        ...
    hub.files["user/repo"]  # {path_in_repo: bytes}
"""

import base64
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COMMIT_OID = "0123456789abcdef0123456789abcdef01234567"


class HubStub:
    def __init__(self):
        self.created_repos: list[str] = []
        self.create_requests: list[dict] = []  # the JSON body of each create_repo request ("visibility", ...)
        self.files: dict[str, dict[str, bytes]] = {}
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "HubStub":
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test output quiet
                pass

            def _reply(self, status: int, payload: dict) -> None:
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._reply(404, {"error": "not found"})

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                path = self.path.split("?")[0]
                if path == "/api/repos/create":
                    request = json.loads(body)
                    repo_id = "/".join(part for part in (request.get("organization"), request["name"]) if part)
                    hub.created_repos.append(repo_id)
                    hub.create_requests.append(request)
                    return self._reply(200, {"url": f"{hub.endpoint}/{repo_id}"})
                if path == "/api/validate-yaml":
                    return self._reply(200, {})
                if match := re.fullmatch(r"/api/models/(.+)/preupload/[^/]+", path):
                    files = [
                        {"path": entry["path"], "uploadMode": "regular", "shouldIgnore": False}
                        for entry in json.loads(body)["files"]
                    ]
                    return self._reply(200, {"files": files})
                if match := re.fullmatch(r"/api/models/(.+)/commit/[^/]+", path):
                    repo_id = match.group(1)
                    for line in body.decode().splitlines():
                        entry = json.loads(line)
                        if entry["key"] == "file":
                            value = entry["value"]
                            hub.files.setdefault(repo_id, {})[value["path"]] = base64.b64decode(value["content"])
                    return self._reply(
                        200,
                        {
                            "commitUrl": f"{hub.endpoint}/{repo_id}/commit/{COMMIT_OID}",
                            "commitOid": COMMIT_OID,
                            "pullRequestUrl": None,
                        },
                    )
                self._reply(404, {"error": f"the hub stub does not answer POST {path}"})

        return Handler
