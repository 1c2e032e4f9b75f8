{{/*
`replica.engine: vllm`: the replica pod's two containers, a stock vLLM server (the OpenAI API on
the port named `http`, prefix caching, ZMQ KV events with a replay socket) and `kvroute bridge`
beside it, which writes vLLM's events, load and address to Redis as a kvroute replica would
(docs/DESIGN.md §3.4). The routers discover the pods by the `http` port and send requests there.
*/}}
{{- define "kvroute.vllmModelPath" -}}
{{- if eq .Values.replica.model.source "generate" -}}
/models/kvroute-tiny-llama
{{- else -}}
{{ include "kvroute.modelDir" . }}
{{- end -}}
{{- end }}

{{- define "kvroute.vllmContainers" -}}
{{- $v := .Values.replica.vllm }}
{{- $model := include "kvroute.vllmModelPath" . }}
{{- $events := dict "enable_kv_cache_events" true "publisher" "zmq" "endpoint" (printf "tcp://*:%d" (int $v.eventsPort)) "replay_endpoint" (printf "tcp://*:%d" (int $v.replayPort)) "topic" "kv" }}
- name: vllm
  image: {{ include "kvroute.image" (dict "ctx" . "image" $v.image) }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  command: ["python", "-m", "vllm.entrypoints.openai.api_server"]
  args:
    - --model
    - {{ $model | quote }}
    - --served-model-name
    - {{ base $model | quote }}
    - --host
    - "0.0.0.0"
    - --port
    - {{ $v.port | quote }}
    - --block-size
    - {{ .Values.cluster.blockSize | quote }}
    - --enable-prefix-caching
    - --enable-prompt-tokens-details
    - --kv-events-config
    - {{ toJson $events | quote }}
    {{- range $v.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  ports:
    - name: http
      containerPort: {{ $v.port }}
      protocol: TCP
  env:
    - name: HOME
      value: /tmp
    - name: HF_HUB_OFFLINE
      value: "1"
    {{- with $v.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  # Model load and warm-up before /health answers: the startup budget is periodSeconds x failureThreshold.
  startupProbe:
    httpGet:
      path: /health
      port: http
    periodSeconds: {{ .Values.replica.startupProbe.periodSeconds }}
    failureThreshold: {{ .Values.replica.startupProbe.failureThreshold }}
  readinessProbe:
    httpGet:
      path: /health
      port: http
    periodSeconds: {{ .Values.replica.readinessProbe.periodSeconds }}
    failureThreshold: {{ .Values.replica.readinessProbe.failureThreshold }}
  livenessProbe:
    httpGet:
      path: /health
      port: http
    periodSeconds: {{ .Values.replica.livenessProbe.periodSeconds }}
    failureThreshold: {{ .Values.replica.livenessProbe.failureThreshold }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  resources:
    {{- include "kvroute.replica.resources" . | nindent 4 }}
  volumeMounts:
    {{- include "kvroute.modelMount" . | nindent 4 }}
    - name: dshm
      mountPath: /dev/shm
    - name: tmp
      mountPath: /tmp
- name: bridge
  image: {{ include "kvroute.image" (dict "ctx" . "image" .Values.router.image) }}
  imagePullPolicy: {{ .Values.router.image.pullPolicy }}
  command: ["kvroute", "bridge"]
  env:
    {{- include "kvroute.commonEnv" (dict "ctx" . "component" "bridge") | nindent 4 }}
    # vLLM listens on every interface of the pod: its own IP is as good as loopback.
    - name: KVROUTE_VLLM_URL
      value: "http://$(POD_IP):{{ $v.port }}"
    - name: KVROUTE_KV_EVENTS
      value: "tcp://127.0.0.1:{{ $v.eventsPort }}"
    - name: KVROUTE_KV_REPLAY
      value: "tcp://127.0.0.1:{{ $v.replayPort }}"
    - name: KVROUTE_KV_TOPIC
      value: kv
    - name: KVROUTE_MODEL
      value: {{ $model | quote }}
    # The pod name is the replica id: a restarted pod is the same replica (with a new epoch).
    - name: KVROUTE_REPLICA_ID
      value: "$(POD_NAME)"
    # What the routers' discovery sees (the EndpointSlice's pod IP and `http` port, or under static
    # discovery the pod's stable DNS name): where they send requests.
    - name: KVROUTE_ADVERTISE_ADDRESS
      {{- if eq .Values.router.discovery "static" }}
      value: "$(POD_NAME).{{ include "kvroute.replica.name" . }}.$(POD_NAMESPACE).svc:{{ $v.port }}"
      {{- else }}
      value: "$(POD_IP):{{ $v.port }}"
      {{- end }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  resources:
    {{- toYaml .Values.replica.bridge.resources | nindent 4 }}
  volumeMounts:
    {{- include "kvroute.modelMount" . | nindent 4 }}
    - name: tmp
      mountPath: /tmp
    {{- include "kvroute.redisCaMount" . | nindent 4 }}
{{- end }}

{{/* The port the routers send a replica's requests to: vLLM's HTTP port, or kvroute's gRPC port. */}}
{{- define "kvroute.replica.servingPort" -}}
{{- if eq .Values.replica.engine "vllm" }}{{ .Values.replica.vllm.port }}{{ else }}{{ .Values.replica.port }}{{ end }}
{{- end }}
