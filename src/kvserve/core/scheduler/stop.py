"""Token-level stop conditions, checked as soon as a token is appended."""

from __future__ import annotations

from kvserve.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int | None) -> RequestStatus | None:
    """The finished status the request's newest token puts it in, or None to keep going
    (`max_model_len` None: no context limit). Stop strings need detokenized text and are
    checked by the engine."""
    token = request.output_token_ids[-1]
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= request.max_tokens or (
            max_model_len is not None and request.num_tokens >= max_model_len):
        return RequestStatus.FINISHED_LENGTH
    return None
