"""The weight stream: lossless deltas of the policy from the trainer to rollout hosts.

  codecs      bits in, bytes out, patches back (the coder sits behind one interface)
  manifest    key layout, manifests, checksums, params <-> named tensors
  store       one tensorstore kvstore (memory, file, gcs, read-only http)
  publisher   trainer side: publish(params, version), keyframes, garbage collection
  subscriber  rollout side: poll(), verified in-place apply, fallback to keyframes
"""

from rljax.sync.manifest import Manifest, StreamError
from rljax.sync.publisher import Publisher
from rljax.sync.store import Store
from rljax.sync.subscriber import Subscriber
