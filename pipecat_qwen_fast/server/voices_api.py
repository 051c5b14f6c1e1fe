"""Voices over HTTP: ``GET /v1/audio/voices`` lists them, ``POST /v1/audio/voices`` clones one
from an uploaded recording (Base models), ``DELETE /v1/audio/voices/{name}`` removes a clone.

The upload is multipart: ``file`` (WAV, FLAC, OGG or MP3, 1-30 s), ``name``, and optionally
``ref_text``, the recording's transcript (an in-context voice; without it, an x-vector-only one).
Its body is bounded before it is parsed. The encoders run on a worker thread, so streams on the
event loop keep flowing while a voice is made; the engine's voice library is thread-safe. A voice
made here is used by name as ``voice`` in /v1/audio/speech and in a WebSocket's session.config.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from pipecat_qwen_fast import InvalidInputError
from pipecat_qwen_fast.voices.voice import check_name

from .api_errors import ApiError, bad_request
from .context import ServerContext, context_of
from .inline_voices import check_ref_text, encode_voice

logger = logging.getLogger("pipecat_qwen_fast.server")

router = APIRouter()

# 30 s (the longest reference the engine takes) of 48 kHz stereo 24-bit WAV is 8.6 MB; the rest
# is room for the form's other fields.
MAX_UPLOAD_BYTES = 10 * 1024 * 1024
UPLOAD_FIELDS = frozenset({"file", "name", "ref_text"})


@router.get("/v1/audio/voices")
async def list_voices(request: Request) -> JSONResponse:
    ctx = context_of(request)
    ctx.authorize(request.headers)
    book = ctx.voice_book()
    cloned = book.library.names() if book.library is not None else []
    return JSONResponse({"voices": book.names(), "cloned": cloned, "aliases": book.aliases,
                         "languages": book.languages, "model_type": ctx.require_ready().model_type})


@router.post("/v1/audio/voices")
async def upload_voice(request: Request) -> JSONResponse:
    ctx = context_of(request)
    ctx.authorize(request.headers)
    library = base_library(ctx)
    form = await read_form(request)
    try:
        name = form_text(form, "name", required=True)
        try:
            check_name(name)
        except InvalidInputError as exc:
            raise bad_request(str(exc), "name") from None
        ref_text = form_text(form, "ref_text", required=False)
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise bad_request("'file' is required: the recording, as a multipart file", "file")
        audio = await upload.read()
    finally:
        await form.close()
    if not audio:
        raise bad_request("'file' is empty", "file")
    check_ref_text(ref_text)
    async with ctx.voice_upload_lock:
        if name in library or name.lower() in ctx.voice_book().voices:
            raise ApiError(409, f"a voice named {name!r} already exists; delete it first or "
                           "choose another name", param="name", code="voice_exists")
        voice = await encode_voice(ctx, audio, ref_text, "file", name=name)
    logger.info("voice created: %s, %.1f s, %s", voice.name, voice.ref_seconds,
                "icl" if voice.prompt.icl else "x-vector")
    return JSONResponse({"name": voice.name, "ref_seconds": voice.ref_seconds,
                         "mode": "icl" if voice.prompt.icl else "x_vector"}, status_code=201)


@router.delete("/v1/audio/voices/{name}")
async def delete_voice(name: str, request: Request) -> Response:
    ctx = context_of(request)
    ctx.authorize(request.headers)
    library = base_library(ctx)
    async with ctx.voice_upload_lock:
        if name not in library:
            raise ApiError(404, f"no uploaded voice named {name!r}", param="name",
                           code="voice_not_found")
        # Off the loop: with the engine in its own process, removal waits for that process.
        await asyncio.to_thread(library.remove, name)
    return Response(status_code=204)


def base_library(ctx: ServerContext):
    service = ctx.require_ready()
    if service.model_type != "base":
        raise bad_request(f"voices can be uploaded only to a Base model; this server runs a "
                          f"{service.model_type} model", "model")
    return service.engine.voice_library


async def read_form(request: Request):
    """The multipart form, refused with 413 as soon as the body passes the bound."""
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        raise bad_request("upload the recording as multipart/form-data (fields: file, name, "
                          "ref_text)")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_UPLOAD_BYTES:
        raise too_large(int(declared))

    async def bounded() -> AsyncIterator[bytes]:
        size = 0
        async for piece in request.stream():
            size += len(piece)
            if size > MAX_UPLOAD_BYTES:
                raise too_large(size)
            yield piece

    parser = MultiPartParser(request.headers, bounded(), max_files=1,
                             max_fields=len(UPLOAD_FIELDS))
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        raise bad_request(f"the multipart body is not valid ({exc.message})") from None
    unknown = sorted(set(form.keys()) - UPLOAD_FIELDS)
    if unknown:
        await form.close()
        raise bad_request(f"unknown field(s): {', '.join(map(repr, unknown))}; valid fields: "
                          f"{', '.join(sorted(UPLOAD_FIELDS))}", unknown[0])
    return form


def form_text(form, name: str, *, required: bool) -> str | None:
    value = form.get(name)
    if value is None or (isinstance(value, str) and not value.strip() and not required):
        if required:
            raise bad_request(f"'{name}' is required", name)
        return None
    if not isinstance(value, str):
        raise bad_request(f"'{name}' must be a text field, not a file", name)
    return value


def too_large(size: int) -> ApiError:
    return ApiError(413, f"the upload is {size} bytes or more; the limit is {MAX_UPLOAD_BYTES}",
                    code="upload_too_large")
