"""Learning: turns become judged samples (`collector`, with `feedback` from SDK users), samples
become token advantages (`advantages`, pure), batches become training steps and published
versions (`trainer`, with what each sample trains from `distillation`), each candidate is judged
and served or held back (`promotion`, with the `gate`), and `learner` runs collection and
training beside the server. Imports neither the proxy nor the faces."""
