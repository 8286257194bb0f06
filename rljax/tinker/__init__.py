"""A Tinker-compatible training service (the `tinker` SDK's HTTP API) on rljax's model:
LoRA training clients on one base model (`training`), the SDK's protobuf messages
(`wire`), sessions / futures / request order (`service`) and the HTTP routes (`server`)."""
