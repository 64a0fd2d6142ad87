"""Serving: an OpenAI-compatible HTTP endpoint on a policy, and rollouts recorded from it.

`Server(policy, tokenizer)` answers `POST /v1/chat/completions`, `POST /v1/completions`
and `GET /v1/models` (OpenAI's JSON, plus each choice's `token_ids` and the
`prompt_token_ids` as vLLM returns them), on 127.0.0.1, from one scheduler thread that
samples every waiting request with the continuous-batching sampler
(`rlhf_eqx.generate_continuous`, each row with its own temperature, top-k, top-p and min-p).
`"stream": true` answers as server-sent events whose pieces never cut a UTF-8
character; a client that disconnects has its rows dropped; a request beyond
`max_request_rows` / `max_request_tokens` is refused. `rlhf_eqx serve --model NAME`
runs one from the command line.

Rollout mode: any code that speaks OpenAI's protocol (an agent loop with tools, the
`openai` client) drives episodes; inside `with server.recording() as rec:` each
completion's prompt ids, completion ids and behaviour log-probabilities are kept per
episode (requests tagged with `episode_id`, or `user`), `rec.reward(episode_id, r)`
(or `POST /v1/episodes/{episode_id}/reward`) takes the environment's reward, and
`rec.grpo_batch()` / `rec.trajectory()` give the training batch in the multi-turn
rollouts' layout (observations out of the loss).
`server.update_policy(new_policy)` swaps the weights between iterations.
"""

from ._command import serve_command as serve_command
from ._protocol import RequestError as RequestError
from ._recording import Episode as Episode, Recording as Recording, Turn as Turn
from ._server import Server as Server
