"""The runtime between Prefect's tasks and the training ranks: launching and watching
`accelerate launch` (launcher), the network it needs (network), the MLflow sender that the
ranks' metrics go through (mlflow_logging), the secrets a launch may pass on (credentials) and a
flow run's tie to its worker (infrastructure). Nothing here is a Prefect task: tasks/ composes
these, and the ranks under training/ know none of them."""
