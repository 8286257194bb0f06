"""A Tinker-compatible training service (the `tinker` SDK's HTTP API) on rljax's model:
LoRA training clients on one base model (`training`), sampling clients on the decode
engine (`sampling`), saved training states (`states`), the SDK's protobuf messages
(`wire`), sessions / futures / request order (`service`) and the HTTP routes (`server`)."""
