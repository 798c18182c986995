"""Generated protobuf contracts (talaria.v1). Do not edit: run `talaria proto gen`."""
