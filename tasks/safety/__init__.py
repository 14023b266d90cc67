"""Bias and toxicity evaluation of every exported model: CrowS-Pairs through lm-eval, and the
toxicity of sampled continuations of ToxiGen prompts, scored by a lexicon and a small classifier."""
