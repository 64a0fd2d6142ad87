r"""A generative judge as a reward: a language model's verdict token after a judging prompt.

The judge is a causal LM (any `Policy`, or a model `(tokens, mask) -> logits [T, V]`)
asked, through a text `template`, whether a completion is good; the reward is read off
its next-token distribution after the template:

$$s = \log p(\texttt{yes}\mid x) - \log p(\texttt{no}\mid x)\quad(\texttt{"log\_odds"}),
\qquad s = p(\texttt{yes}\mid x)\quad(\texttt{"prob"})$$

with $x$ = `template(prompt, completion)` (Zheng et al. 2023, "Judging LLM-as-a-Judge";
the verdict-token probability of generative verifiers, Zhang et al. 2024). The two parts
are kept apart:

- `judge_scores`: the pure, jitted core on token arrays — one batched forward pass
  (for a `Policy`, the LM head runs at the last real position of each row only);
- `JudgeReward` (built by `judge_reward`): host-side templating and tokenisation, then
  `judge_scores` on all rows at once. It is a reward function `(prompt, completion) ->
  float`, so `RewardFunction("judge", judge)` works in `score_rollout` (one forward pass
  per completion); `judge.for_rollout(rollout)` scores a whole rollout in one pass and
  returns the reward function that looks the scores up.
"""

import dataclasses
import math
import string
from collections.abc import Callable, Sequence
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Float32, Int, Int32

from ..data import Tokenizer, wants_bos
from ..models import Policy, last_real_index
from ._accumulate import vmap_model
from ._validation import check_choice, check_positive_int

JUDGE_SCORES = ("log_odds", "prob")
"""The values of `verdict_scores(..., score=)` and `judge_scores(..., score=)`: the log-odds
of the yes token against the no token, or the probability of the yes token."""
JudgeScore = Literal["log_odds", "prob"]


def verdict_scores(
    logits: Float[Array, "*B V"], yes_id: int, no_id: int, *, score: JudgeScore = "log_odds"
) -> Float[Array, "*B"]:
    r"""The judge's score from its next-token logits $z$ (float32).

    `"log_odds"`: $\log p(\texttt{yes}) - \log p(\texttt{no}) = z_{\rm yes} - z_{\rm no}$
    (the normaliser cancels, so it is computed as the logit difference, exact for any
    logits); `"prob"`: $p(\texttt{yes}) = \exp(z_{\rm yes} - \mathrm{logsumexp}(z))$.
    """
    check_choice("score", score, JUDGE_SCORES)
    z = logits.astype(jnp.float32)
    if score == "log_odds":
        return z[..., yes_id] - z[..., no_id]
    return jnp.exp(z[..., yes_id] - jax.nn.logsumexp(z, axis=-1))


@eqx.filter_jit
def _judge_scores(model, tokens, mask, yes_id, no_id, score):
    last = last_real_index(mask)
    if isinstance(model, Policy):
        hidden = model.transformer.hidden_at(tokens, mask, last[:, None])[:, 0]
        logits = model.logits_from_hidden(hidden)
    else:
        full = vmap_model(model, tokens, mask, None)
        logits = jnp.take_along_axis(full, last[:, None, None], axis=1)[:, 0]
    return verdict_scores(logits, yes_id, no_id, score=score)


def judge_scores(
    model: Any,
    tokens: Int[Array, "B T"],
    mask: Bool[Array, "B T"],
    *,
    yes_id: int,
    no_id: int,
    score: JudgeScore = "log_odds",
) -> Float[Array, " B"]:
    """The verdict score of each row (`verdict_scores` of the logits after its last real
    token), in one jitted, batched forward pass of `model` (a `Policy`, or any
    `(tokens, mask) -> logits [T, V]` model)."""
    check_choice("score", score, JUDGE_SCORES)
    return _judge_scores(model, tokens, mask, int(yes_id), int(no_id), score)


def _token_id(tokenizer: Tokenizer, token: str | int, name: str) -> int:
    if isinstance(token, bool):
        raise ValueError(f"{name} must be a string or a token id, got {token!r}")
    if isinstance(token, int):
        if not 0 <= token < tokenizer.vocab_size:
            raise ValueError(
                f"{name}={token} is outside the vocabulary [0, {tokenizer.vocab_size})"
            )
        return token
    ids = list(tokenizer.encode(token))
    if len(ids) != 1:
        raise ValueError(
            f"{name}={token!r} encodes to {len(ids)} tokens {ids}; give a string that is one "
            "token (e.g. with or without a leading space) or the token id"
        )
    return int(ids[0])


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


@dataclasses.dataclass(frozen=True, eq=False)
class JudgeReward:
    """A generative judge as a reward function `(prompt, completion) -> float` (host side).

    Built by `judge_reward`; see there for the fields (`chat_template`: the
    `data.JinjaChatTemplate` of `chat=True`, else `None`). `score(prompts, completions)`
    scores many at once, `__call__` one, `for_rollout(rollout)` a whole rollout.
    """

    model: Any
    tokenizer: Tokenizer
    template: str | Callable[[str, str], str]
    yes_id: int
    no_id: int
    score_kind: JudgeScore = "log_odds"
    max_length: int = 1024
    bucket_size: int = 16
    batch_size: int | None = None
    chat_template: Any = None

    def render(self, prompt: str, completion: str) -> str:
        """The judging text of one completion; with a `chat_template`, that text as one
        user message through it, then the generation prompt (a BOS text it writes first
        is dropped when the tokenizer adds BOS itself, so there is one)."""
        if callable(self.template):
            text = self.template(prompt, completion)
        else:
            text = self.template.format_map({"prompt": prompt, "completion": completion})
        chat = self.chat_template
        if chat is None:
            return text
        out = chat.render([{"role": "user", "content": text}], add_generation_prompt=True)
        bos = chat.bos_token if wants_bos(self.tokenizer) else ""
        return out[len(bos) :] if bos and out.startswith(bos) else out

    def encode(
        self, prompts: Sequence[str], completions: Sequence[str]
    ) -> tuple[Int32[np.ndarray, "N T"], Bool[np.ndarray, "N T"]]:
        """`(tokens [N, T], mask [N, T])`: `encode(render(p, c))`, after BOS when the
        tokenizer asks for it (`data.wants_bos`), right-padded to a multiple of
        `bucket_size` (at most `max_length`). A text longer than `max_length` keeps its
        end (the question and the place of the verdict), BOS first."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        tok = self.tokenizer
        rows, bos = [], [tok.bos_id] if wants_bos(tok) else []
        for p, c in zip(prompts, completions):
            ids = bos + list(tok.encode(self.render(p, c)))
            if len(ids) > self.max_length:
                ids = bos + ids[len(ids) - (self.max_length - len(bos)) :]
            rows.append(ids)
        longest = max((len(r) for r in rows), default=1)
        T = min(self.max_length, -(-longest // self.bucket_size) * self.bucket_size)
        tokens = np.full((len(rows), T), tok.pad_id, np.int32)
        mask = np.zeros((len(rows), T), bool)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = r
            mask[i, : len(r)] = True
        return tokens, mask

    def score(
        self, prompts: Sequence[str], completions: Sequence[str]
    ) -> Float32[np.ndarray, " N"]:
        """Scores `[N]` (float32) of the pairs `(prompts[i], completions[i])`: all rows in one
        batched forward pass (`batch_size` rows at a time when set). Rows are padded up to
        a power of two (or to `batch_size`), so a handful of shapes are compiled."""
        tokens, mask = self.encode(prompts, completions)
        n = tokens.shape[0]
        if n == 0:
            return np.zeros((0,), np.float32)
        chunk = self.batch_size or _pow2(n)
        out = []
        for start in range(0, n, chunk):
            t, m = tokens[start : start + chunk], mask[start : start + chunk]
            rows = t.shape[0]
            size = chunk if self.batch_size else _pow2(rows)
            if size > rows:  # filler rows: a lone BOS
                fill_t = np.full((size - rows, t.shape[1]), self.tokenizer.pad_id, np.int32)
                fill_t[:, 0] = self.tokenizer.bos_id
                fill_m = np.zeros((size - rows, t.shape[1]), bool)
                fill_m[:, 0] = True
                t, m = np.concatenate([t, fill_t]), np.concatenate([m, fill_m])
            s = judge_scores(
                self.model,
                jnp.asarray(t),
                jnp.asarray(m),
                yes_id=self.yes_id,
                no_id=self.no_id,
                score=self.score_kind,
            )
            out.append(np.asarray(s, np.float32)[:rows])
        return np.concatenate(out)

    def __call__(self, prompt: str, completion: str) -> float:
        """The score of one completion (a reward function for `score_rollout`)."""
        return float(self.score([prompt], [completion])[0])

    def for_rollout(self, rollout: Any) -> Callable[[str, str], float]:
        """Score every completion of `rollout` (anything with `.prompts` and `.texts`, e.g.
        a `rlhf_eqx.pipelines.runs.Rollout`) in one batched pass, and return the reward
        function `(prompt, completion) -> float` that reads those scores (a pair not in the
        rollout is scored on its own): `RewardFunction("judge", judge.for_rollout(roll))`
        then costs `score_rollout` one forward pass for the whole rollout."""
        prompts, texts = list(rollout.prompts), list(rollout.texts)
        table = dict(zip(zip(prompts, texts), self.score(prompts, texts).tolist()))

        def reward(prompt: str, completion: str) -> float:
            found = table.get((prompt, completion))
            return self(prompt, completion) if found is None else float(found)

        return reward


def judge_reward(
    model: Any,
    tokenizer: Tokenizer,
    *,
    template: str | Callable[[str, str], str],
    yes_token: str | int,
    no_token: str | int,
    score: JudgeScore = "log_odds",
    max_length: int | None = None,
    bucket_size: int = 16,
    batch_size: int | None = None,
    chat: bool = False,
) -> JudgeReward:
    """A generative judge (`JudgeReward`): `model` scores `template(prompt, completion)`
    by its next-token verdict.

    **Arguments:**

    - `model`: the judge, a `Policy` (or any `(tokens, mask) -> logits [T, V]` model).
    - `tokenizer`: its tokenizer; texts become `tokenizer.encode(text)`, after BOS when
      the tokenizer asks for it (`data.wants_bos`: not SmolLM2's, whose BOS id is
      `<|im_start|>`, which its chat template writes).
    - `template`: a format string with `{prompt}` and `{completion}` fields (literal
      braces doubled; one without `{completion}` is refused), or a function
      `(prompt, completion) -> str`. It should end where
      the verdict comes, e.g. `"...Is the answer correct? Answer:"`.
    - `yes_token`, `no_token`: the verdict tokens, as strings that encode to one token
      each (e.g. `" Yes"`, `" No"`), or ids; two different tokens.
    - `score`: `"log_odds"` (log p(yes) - log p(no)) or `"prob"` (p(yes)).
    - `max_length`: the longest judging text in tokens (default: the model's
      `cfg.max_seq_len`, else 1024); longer texts keep their end.
    - `bucket_size`: rows are padded to a multiple of this many tokens.
    - `batch_size`: at most this many rows per forward pass (`None`: all at once).
    - `chat`: a chat judge: the judging text is one user message through the
      tokenizer's chat template (`tokenizer.jinja_chat_template()`), then the generation
      prompt, so the verdict is the first token of the reply (e.g. `"Yes"` / `"No"`
      without a leading space). Off: the text as written, e.g. after a prompt that a
      data-file run already rendered through the template.
    """
    check_choice("score", score, JUDGE_SCORES)
    check_positive_int("bucket_size", bucket_size)
    if batch_size is not None:
        check_positive_int("batch_size", batch_size)
    if max_length is None:
        cfg = getattr(model, "cfg", None)
        max_length = int(getattr(cfg, "max_seq_len", 1024))
    check_positive_int("max_length", max_length)
    if not (callable(template) or isinstance(template, str)):
        raise ValueError(f"template must be a format string or a function, got {template!r}")
    if isinstance(template, str):
        try:
            template.format_map({"prompt": "", "completion": ""})
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"template must be a format string with only {{prompt}} and {{completion}} "
                f"fields (double literal braces): {e!r}"
            ) from None
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
        if "completion" not in fields:
            raise ValueError(
                f"template={template!r}: must contain {{completion}} (what the judge reads; "
                "without it every completion of a prompt gets the same score)"
            )
    chat_template = None
    if chat:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("chat=True: the judge's tokenizer carries no chat template")
        chat_template = tokenizer.jinja_chat_template()
    yes_id = _token_id(tokenizer, yes_token, "yes_token")
    no_id = _token_id(tokenizer, no_token, "no_token")
    if yes_id == no_id:  # log p(yes) - log p(no) would be 0 for every completion
        raise ValueError(
            f"yes_token={yes_token!r} and no_token={no_token!r} are the same token (id "
            f"{yes_id}); the verdict needs two different tokens"
        )
    judge = JudgeReward(
        model=model,
        tokenizer=tokenizer,
        template=template,
        yes_id=yes_id,
        no_id=no_id,
        score_kind=score,
        max_length=max_length,
        bucket_size=bucket_size,
        batch_size=batch_size,
        chat_template=chat_template,
    )
    # a format string's own tokens must leave room for a prompt and a completion: longer
    # texts keep their end, so a template that fills `max_length` alone would lose its
    # opening on every text, and a prompt and completion would never be seen (a function
    # template is not called here: it may not accept empty texts)
    own = 0
    if isinstance(template, str):
        own = int(wants_bos(tokenizer)) + len(tokenizer.encode(judge.render("", "")))
    if own >= max_length:
        raise ValueError(
            f"template: the judging text with an empty prompt and completion is already "
            f"{own} tokens (BOS and chat template included), max_length={max_length} leaves "
            "no room for them; shorten the template or raise max_length"
        )
    return judge
