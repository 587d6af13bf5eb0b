"""Several engine replicas behind one endpoint."""
