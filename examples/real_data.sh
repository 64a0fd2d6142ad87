#!/usr/bin/env bash
# The real data formats from the command line, with the shipped stories260K model.
#
# The model is a 260K-parameter story writer with a 512-piece vocabulary: it will not
# learn to be a harmless assistant or to solve grade-school maths here. What these runs
# show is that the real files go through the whole system — readers, truncation report,
# tokenisation, training, held-out evaluation, checkpoints, plots, HF export — and what
# each run measures. Sizes are small so that each finishes in a few minutes on 2 CPU
# cores; raise data.limit and the step counts for real runs.
set -euo pipefail
SHARED=${SHARED:-../shared}
HH=$SHARED/data/hh-rlhf/harmless-base/test.jsonl.gz
GSM8K=$SHARED/data/gsm8k/test.jsonl

# DPO on HH-RLHF (harmless-base): prompts are the dialogue up to the last "Assistant:",
# chosen/rejected the two final replies. Measures the held-out implicit-reward accuracy:
# the fraction of held-out pairs where beta*log(pi/ref) is higher for the chosen reply
# (0.5 = chance). Before training the run logs a data-quality report (identical, empty
# and duplicate pairs, repeated prompts, lengths, the truncation rate and policy at
# sampling.prompt_length / dpo.max_length tokens, distinct-n) to the console, to
# metrics.jsonl (a data_quality event) and to summary.json; data.filter drops the
# identical, empty and exactly duplicated pairs first and logs what went.
# The model's context is 512 tokens and HH prompts are long (median 200 tokens, 90th
# percentile 517 with this tokenizer): data.filter=long_prompt drops the pairs whose
# prompt does not fit sampling.prompt_length, so that no prompt is cut (56% fit 256).
python -m rlhf_eqx dpo --data "$HH" --out runs/hh-dpo \
  --set data.limit=512 --set data.filter=identical,empty,exact_duplicate,long_prompt \
  --set dpo.steps=40 --set dpo.batch_size=8 \
  --set sampling.prompt_length=256 --set dpo.max_length=384 --set dpo.optim.learning_rate=5e-4

# A reward model on the same file. Measures held-out pairwise accuracy (chosen scored
# above rejected; 0.5 = chance). The model is also written as a Hugging Face
# LlamaForSequenceClassification checkpoint in runs/hh-reward/reward/hf/.
python -m rlhf_eqx reward --data "$HH" --out runs/hh-reward \
  --set data.limit=512 --set data.filter=long_prompt --set reward.steps=40 \
  --set reward.batch_size=8 --set sampling.prompt_length=256 --set reward.max_length=384 \
  --set reward.optim.learning_rate=5e-4

# KTO on the same pairs, each split into a desirable (chosen) and an undesirable
# (rejected) example after the held-out split by prompt. Measures the held-out implicit
# rewards of both kinds and the pair accuracy as DPO reports it.
python -m rlhf_eqx kto --data "$HH" --out runs/hh-kto \
  --set data.limit=512 --set data.filter=identical,empty,exact_duplicate,long_prompt \
  --set kto.steps=40 --set kto.batch_size=8 \
  --set sampling.prompt_length=256 --set kto.max_length=384 --set kto.optim.learning_rate=5e-4

# Distillation (GKD) of that KTO policy into the base model, on the chosen responses and,
# for half of the steps, the student's own samples. Measures the held-out generalized JSD
# per completion token before and after.
python -m rlhf_eqx distill --data "$HH" --out runs/hh-distill \
  --set data.limit=512 --set data.filter=identical,empty,exact_duplicate,long_prompt \
  --set distill.steps=40 --set distill.batch_size=8 --set distill.teacher=runs/hh-kto/kto/hf \
  --set sampling.prompt_length=256 --set distill.max_length=384 --set distill.optim.learning_rate=5e-4

# GRPO on GSM8K with the exact-match reward (the number after "####", else the last
# number, against the reference answer). Measures the held-out exact-match rate before
# and after; logs frac_reward_zero_std and warns when no group carries any signal
# (expected for this model: it never produces the right number).
python -m rlhf_eqx grpo --data "$GSM8K" --out runs/gsm8k-grpo \
  --set data.limit=128 --set grpo.rollouts=4 --set grpo.prompts_per_rollout=4 \
  --set grpo.group_size=4 --set sampling.prompt_length=256 --set sampling.max_new_tokens=48
