"""The router as a Gateway API Inference Extension endpoint picker (EPP): Envoy's External
Processing service (``envoy.service.ext_proc.v3.ExternalProcessor/Process``) on the router's
``picker_port`` (router.picker.server: a synchronous grpc.server, a thread per stream, at most
``picker_streams``), answered with the same ``Router`` core as the proxy (DESIGN.md §5).

    gateway (Envoy) ──ProcessingRequest──▶ EndpointPicker.Process (one ext_proc stream per HTTP call)
      request headers    :path, content-type, grpc-timeout          ──▶ CONTINUE
      request body       a GenerationService request in its gRPC frame, or an OpenAI JSON body
                         (router.picker.requests) ──▶ token ids ──▶ Router.decide / commit
                         ──▶ x-gateway-destination-endpoint header + envoy.lb dynamic metadata
                             (picked first, then the fallbacks; the pick for the client's trailers
                             in kvroute.routing metadata), or an ImmediateResponse
                             (400 bad prompt, 503 nothing routable / empty subset, 429 every
                             candidate's heartbeat shows its waiting queue at its max_waiting)
      (later picks)      the replica's heartbeat covers the pick: its pending prefill is released
      response trailers  (a sampled share) grpc-status and the replica's x-kvroute-cached-tokens: the
                         prediction-accuracy metric; x-kvroute-replica / -predicted-cached-tokens added
      stream end         (completion, error, client cancel: Envoy closes the ext_proc stream with
                         the HTTP stream) ──▶ the ticket is finished, exactly once

Consumes: the ext_proc messages of a gateway configured as ``kvroute_tools.envoy`` writes it
(the buffered request body; the response trailers for a sampled share of the calls; not the
response headers, which would hold every call's first bytes for a picker answer). Guarantees: the
endpoint is a routable replica inside the ``x-gateway-destination-endpoint-subset`` hint when one
is given; the load a pick adds is released when the HTTP stream ends, however it ends. The bytes of
the generation never pass through the router.

Modules: ``protocol`` (the protocol's messages, no I/O), ``requests`` (the prompt from the body),
``servicer`` (one stream's pick, load and trailers), ``server`` (the thread-pool gRPC server).
"""
