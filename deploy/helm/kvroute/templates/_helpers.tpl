{{/*
Names, labels and the environment shared by the router and replica templates.
*/}}

{{- define "kvroute.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-<chart>, or the release name when it already contains the chart name. */}}
{{- define "kvroute.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvroute.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Resource names of the parts (<= 63 characters). */}}
{{- define "kvroute.router.name" -}}{{ include "kvroute.fullname" . | trunc 56 | trimSuffix "-" }}-router{{- end }}
{{- define "kvroute.replica.name" -}}{{ include "kvroute.fullname" . | trunc 55 | trimSuffix "-" }}-replica{{- end }}
{{- define "kvroute.redis.name" -}}{{ include "kvroute.fullname" . | trunc 57 | trimSuffix "-" }}-redis{{- end }}

{{/* Selector labels of one part: pass (dict "ctx" $ "component" "router"). */}}
{{- define "kvroute.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvroute.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Every label of one part's resources: pass (dict "ctx" $ "component" "router"). */}}
{{- define "kvroute.labels" -}}
helm.sh/chart: {{ include "kvroute.chart" .ctx }}
{{ include "kvroute.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: kvroute
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "kvroute.router.serviceAccountName" -}}
{{- default (include "kvroute.router.name" .) .Values.router.serviceAccount.name }}
{{- end }}

{{/* An image reference: pass (dict "ctx" $ "image" .Values.router.image). A digest pins the image
and the tag is then ignored (repository@sha256:...); an empty tag is the chart's appVersion, which
only kvroute's own images leave empty (the schema requires the others' tags). */}}
{{- define "kvroute.image" -}}
{{- if .image.digest -}}
{{ .image.repository }}@{{ .image.digest }}
{{- else -}}
{{ .image.repository }}:{{ default .ctx.Chart.AppVersion .image.tag }}
{{- end }}
{{- end }}

{{/* The Redis key namespace of the release. */}}
{{- define "kvroute.namespace" -}}
{{- default .Release.Name .Values.cluster.namespace }}
{{- end }}

{{/* The Redis URL the routers and replicas use. */}}
{{- define "kvroute.redisUrl" -}}
{{- if .Values.redis.enabled -}}
redis://{{ include "kvroute.redis.name" . }}:{{ .Values.redis.port }}/0
{{- else -}}
{{ required "externalRedis.url is required when redis.enabled is false" .Values.externalRedis.url }}
{{- end }}
{{- end }}

{{/* The Secret and key holding the Redis password; empty name when there is none. */}}
{{- define "kvroute.redisSecretName" -}}
{{- if .Values.redis.enabled -}}
{{ default (include "kvroute.redis.name" .) .Values.redis.auth.existingSecret }}
{{- else -}}
{{ .Values.externalRedis.existingSecret }}
{{- end }}
{{- end }}
{{- define "kvroute.redisSecretKey" -}}
{{- if .Values.redis.enabled }}{{ .Values.redis.auth.secretKey }}{{ else }}{{ .Values.externalRedis.secretKey }}{{ end }}
{{- end }}

{{/*
The environment both the routers and the replicas get: Redis (the password from the Secret,
never from plain values), the cluster's hashing, OpenTelemetry. Pass the component name
(dict "ctx" $ "component" "router").
*/}}
{{- define "kvroute.commonEnv" -}}
{{- $ := .ctx }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
# The root filesystem is read-only: caches (torch, the kernels) go to the /tmp emptyDir.
- name: HOME
  value: /tmp
{{- if ne .component "bridge" }}
- name: KVROUTE_HOST
  value: "0.0.0.0"
{{- end }}
- name: KVROUTE_REDIS_URL
  value: {{ include "kvroute.redisUrl" $ | quote }}
{{- $secret := include "kvroute.redisSecretName" $ }}
{{- if $secret }}
- name: KVROUTE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ include "kvroute.redisSecretKey" $ }}
{{- end }}
{{- if and (not $.Values.redis.enabled) $.Values.externalRedis.tls.caSecret }}
- name: KVROUTE_REDIS_CA_FILE
  value: /etc/kvroute/redis-ca/{{ $.Values.externalRedis.tls.caKey }}
{{- end }}
{{- if and (not $.Values.redis.enabled) $.Values.externalRedis.cluster }}
- name: KVROUTE_REDIS_CLUSTER
  value: "true"
{{- end }}
- name: KVROUTE_NAMESPACE
  value: {{ include "kvroute.namespace" $ | quote }}
- name: KVROUTE_EVENT_SHARDS
  value: {{ $.Values.cluster.eventShards | quote }}
- name: KVROUTE_BLOCK_SIZE
  value: {{ $.Values.cluster.blockSize | quote }}
- name: KVROUTE_HASH_ALGORITHM
  value: {{ $.Values.cluster.hashAlgorithm | quote }}
{{- if ne .component "bridge" }}
- name: KVROUTE_MODEL_CACHE_DIR
  value: /models
{{- end }}
{{- with $.Values.otel.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ $.Values.otel.protocol | quote }}
- name: OTEL_EXPORTER_OTLP_INSECURE
  value: {{ $.Values.otel.insecure | quote }}
{{- with $.Values.otel.headers }}
- name: OTEL_EXPORTER_OTLP_HEADERS
  value: {{ . | quote }}
{{- end }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: "k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE),service.namespace={{ include "kvroute.namespace" $ }}"
- name: OTEL_TRACES_SAMPLER
  value: {{ $.Values.otel.sampler | quote }}
{{- with $.Values.otel.samplerArg }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* `settings: {name: value}` as KVROUTE_NAME variables (sorted). Pass the map. */}}
{{- define "kvroute.settingsEnv" -}}
{{- range $k, $v := . }}
- name: KVROUTE_{{ $k | upper }}
  value: {{ $v | toString | quote }}
{{- end }}
{{- end }}

{{/* Volumes for the Redis CA (external Redis with TLS). */}}
{{- define "kvroute.redisCaVolume" -}}
{{- if and (not .Values.redis.enabled) .Values.externalRedis.tls.caSecret }}
- name: redis-ca
  secret:
    secretName: {{ .Values.externalRedis.tls.caSecret }}
{{- end }}
{{- end }}
{{- define "kvroute.redisCaMount" -}}
{{- if and (not .Values.redis.enabled) .Values.externalRedis.tls.caSecret }}
- name: redis-ca
  mountPath: /etc/kvroute/redis-ca
  readOnly: true
{{- end }}
{{- end }}

{{/*
gRPC TLS (tls.enabled): the kubernetes.io/tls Secret mounted read-only at /etc/kvroute/tls, the
settings that point at it (pass (dict "ctx" $ "component" "router")), the client flags of
`kvroute health`, and the probes (exec probes over TLS, else Kubernetes' native gRPC probes).
*/}}
{{- define "kvroute.tlsDir" -}}/etc/kvroute/tls{{- end }}
{{- define "kvroute.tlsVolume" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .Values.tls.existingSecret }}
{{- end }}
{{- end }}
{{- define "kvroute.tlsMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ include "kvroute.tlsDir" . }}
  readOnly: true
{{- end }}
{{- end }}
{{/* The name replica certificates are checked against by the routers and Envoy: the replica
Service's (they dial pod IPs, which no certificate names). */}}
{{- define "kvroute.replica.serverName" -}}
{{ include "kvroute.replica.name" . }}.{{ .Release.Namespace }}.svc
{{- end }}
{{- define "kvroute.tlsEnv" -}}
{{- $ := .ctx }}
{{- $dir := include "kvroute.tlsDir" $ }}
{{- if $.Values.tls.enabled }}
- name: KVROUTE_TLS_CERT_FILE
  value: {{ $dir }}/tls.crt
- name: KVROUTE_TLS_KEY_FILE
  value: {{ $dir }}/tls.key
{{- if $.Values.tls.mutual }}
- name: KVROUTE_TLS_CLIENT_CA_FILE
  value: {{ $dir }}/ca.crt
{{- end }}
{{- if $.Values.tls.http }}
- name: KVROUTE_HTTP_TLS
  value: "true"
{{- end }}
{{- if $.Values.tls.metrics }}
- name: KVROUTE_METRICS_TLS
  value: "true"
{{- end }}
{{- if eq .component "router" }}
- name: KVROUTE_REPLICA_TLS_CA_FILE
  value: {{ $dir }}/ca.crt
- name: KVROUTE_REPLICA_TLS_SERVER_NAME
  value: {{ include "kvroute.replica.serverName" $ }}
{{- if $.Values.tls.mutual }}
- name: KVROUTE_REPLICA_TLS_CERT_FILE
  value: {{ $dir }}/tls.crt
- name: KVROUTE_REPLICA_TLS_KEY_FILE
  value: {{ $dir }}/tls.key
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{/* `kvroute health` TLS flags as a JSON list (empty list without TLS). */}}
{{- define "kvroute.healthTlsArgs" -}}
{{- $dir := include "kvroute.tlsDir" . }}
{{- $args := list }}
{{- if .Values.tls.enabled }}
{{- $args = list "--tls-ca-file" (printf "%s/ca.crt" $dir) "--tls-server-name" (include "kvroute.router.name" .) }}
{{- if .Values.tls.mutual }}
{{- $args = concat $args (list "--tls-cert-file" (printf "%s/tls.crt" $dir) "--tls-key-file" (printf "%s/tls.key" $dir)) }}
{{- end }}
{{- end }}
{{- toJson $args }}
{{- end }}
{{/* One probe: pass (dict "ctx" $ "port" 50050 "service" "readiness" "probe" .Values.router.readinessProbe). */}}
{{- define "kvroute.probe" -}}
{{- if .ctx.Values.tls.enabled }}
exec:
  command: {{ concat (list "kvroute" "health" "--service" .service "--target" (printf "127.0.0.1:%d" (int .port)) "--timeout" "3") (include "kvroute.healthTlsArgs" .ctx | fromJsonArray) | toJson }}
# A Python process per check: more than the native probe's one second.
timeoutSeconds: 5
{{- else }}
grpc:
  port: {{ .port }}
  service: {{ .service }}
{{- end }}
periodSeconds: {{ .probe.periodSeconds }}
failureThreshold: {{ .probe.failureThreshold }}
{{- end }}

{{/*
The model volume and where the model folder is in it: `generate` writes the default model and
`download` fetches a Hugging Face repo into an emptyDir with an init container; `pvc` / `hostPath`
mount an existing one.
*/}}
{{- define "kvroute.modelVolume" -}}
{{- $m := .Values.replica.model }}
- name: models
{{- if eq $m.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ required "replica.model.claimName is required with model.source pvc" $m.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
  hostPath:
    path: {{ required "replica.model.hostPath is required with model.source hostPath" $m.hostPath }}
    type: Directory
{{- else if eq $m.source "download" }}
  emptyDir:
    sizeLimit: {{ $m.download.sizeLimit }}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end }}
{{/* The model folder the engine and the routers' tokenizer read (every source but `generate`):
/models/<model.path>; with `download` and no path, the repo's name (the folder name is the served
model's name). */}}
{{- define "kvroute.modelDir" -}}
{{- $m := .Values.replica.model }}
{{- $path := $m.path }}
{{- if and (eq $m.source "download") (not $path) }}
{{- $path = base $m.download.repo }}
{{- end }}
{{- printf "/models/%s" ($path | trimPrefix "/") | trimSuffix "/" }}
{{- end }}
{{- define "kvroute.modelEnv" -}}
{{- if ne .Values.replica.model.source "generate" }}
- name: KVROUTE_MODEL
  value: {{ include "kvroute.modelDir" . | quote }}
{{- end }}
{{- end }}
{{- define "kvroute.modelMount" -}}
- name: models
  mountPath: /models
  readOnly: {{ ne .Values.replica.model.source "generate" }}
{{- end }}

{{/*
The init container that fills the model volume (model.source generate or download; none
otherwise). Pass (dict "ctx" $ "component" "router").
- generate: kvroute_tools.resolve_model writes the default model to /models.
- download: huggingface_hub's snapshot_download fetches model.download.repo at its revision from
  HF_ENDPOINT (the Hub, or a Hub-compatible mirror or proxy) into kvroute.modelDir, the folder
  the engine then reads as it would a PVC's.
The routers only tokenize: they run their own image (no torch, no CUDA replica image to pull;
model.download.image, when set, downloads in both) and take the folder without weights
(generate: --tokenizer-only; download: only the files kvroute.tokenizer and
kvroute.prompt.PromptTokenizer read).
*/}}
{{- define "kvroute.generateModelInit" -}}
{{- $ := .ctx }}
{{- $m := $.Values.replica.model }}
{{- if has $m.source (list "generate" "download") }}
{{- $router := eq .component "router" }}
{{- $image := ternary $.Values.router.image $.Values.replica.image $router }}
{{- if and (eq $m.source "download") $m.download.image.repository }}
{{- $image = $m.download.image }}
{{- end }}
- name: {{ $m.source }}-model
  image: {{ include "kvroute.image" (dict "ctx" $ "image" $image) }}
  imagePullPolicy: {{ $image.pullPolicy }}
  {{- if eq $m.source "generate" }}
  command: {{ concat (list "python" "-m" "kvroute_tools.resolve_model") (ternary (list "--tokenizer-only") list $router) (list "" "/models") | toJson }}
  env:
    - name: HOME
      value: /tmp
  {{- else }}
  {{- $d := $m.download }}
  {{- /* The values go in as arguments, not into the code: a repo id or revision is never Python. */}}
  {{- $code := "import sys; from huggingface_hub import snapshot_download; snapshot_download(repo_id=sys.argv[1], revision=sys.argv[2], local_dir=sys.argv[3], allow_patterns=sys.argv[4:] or None)" }}
  {{- $tokenizerFiles := list "tokenizer.json" "tokenizer_config.json" "special_tokens_map.json" "chat_template.jinja" "generation_config.json" "config.json" }}
  {{- $repo := required "replica.model.download.repo is required with model.source download (a Hugging Face repo id, e.g. Qwen/Qwen2.5-0.5B-Instruct)" $d.repo }}
  command: {{ concat (list "python" "-c" $code $repo $d.revision (include "kvroute.modelDir" $)) (ternary $tokenizerFiles list $router) | toJson }}
  env:
    - name: HOME
      value: /tmp
    # huggingface_hub's own files (Xet's caches) go to the volume, beside the model folder: the root
    # filesystem is read-only.
    - name: HF_HOME
      value: /models/.huggingface
    # A one-off download: no Xet chunk cache (up to 10 GB in some builds) eating the sizeLimit.
    - name: HF_XET_CHUNK_CACHE_SIZE_BYTES
      value: "0"
    - name: HF_HUB_DISABLE_TELEMETRY
      value: "1"
    {{- with $d.endpoint }}
    - name: HF_ENDPOINT
      value: {{ . | quote }}
    {{- end }}
    {{- with $d.tokenSecret.name }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ . }}
          key: {{ $d.tokenSecret.key }}
    {{- end }}
  {{- end }}
  securityContext:
    {{- toYaml $.Values.securityContext | nindent 4 }}
  resources:
    {{- if eq $m.source "generate" }}
    requests:
      cpu: 100m
      memory: 256Mi
    limits:
      memory: 2Gi
    {{- else }}
    {{- toYaml $m.download.resources | nindent 4 }}
    {{- end }}
  volumeMounts:
    - name: models
      mountPath: /models
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end }}

{{/* Default topology spread of one part: over nodes, best effort. Pass (dict "ctx" $ "component" "router" "constraints" list). */}}
{{- define "kvroute.topologySpread" -}}
{{- if .constraints }}
{{- toYaml .constraints }}
{{- else }}
- maxSkew: 1
  topologyKey: kubernetes.io/hostname
  whenUnsatisfiable: ScheduleAnyway
  labelSelector:
    matchLabels:
      {{- include "kvroute.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end }}

{{/* Static discovery: the replica StatefulSet pods' stable DNS names, comma-separated. */}}
{{- define "kvroute.staticReplicas" -}}
{{- $name := include "kvroute.replica.name" . }}
{{- $addrs := list }}
{{- range $i := until (int .Values.replica.replicas) }}
{{- $addrs = append $addrs (printf "%s-%d.%s.%s.svc:%d" $name $i $name $.Release.Namespace (int (include "kvroute.replica.servingPort" $))) }}
{{- end }}
{{- join "," $addrs }}
{{- end }}

{{/* Resource names of the gateway parts. */}}
{{- define "kvroute.envoy.name" -}}{{ include "kvroute.fullname" . | trunc 57 | trimSuffix "-" }}-envoy{{- end }}
{{- define "kvroute.inferencePool.name" -}}{{ default (include "kvroute.fullname" .) .Values.gateway.inferencePool.name }}{{- end }}

{{/* Envoy's bootstrap (JSON): files/envoy-bootstrap.json (envoy-bootstrap-tls.json with
tls.enabled), which is kvroute_tools.envoy.bootstrap's output (tests/deploy/envoy_chart.py writes
it), with the release's addresses put in, and a listener for the kubelet that answers only /ready,
from the admin's /ready (the admin itself stays on 127.0.0.1). With TLS: the router's certificate
is checked against the router Service's name, the replicas' against the replica Service's
(<replica>.<namespace>.svc: Envoy dials pod IPs), and tls.mutual makes the listener require a
client certificate of ca.crt. */}}
{{- define "kvroute.envoy.bootstrap" -}}
{{- $e := .Values.gateway.envoy }}
{{- $b := .Files.Get (ternary "files/envoy-bootstrap-tls.json" "files/envoy-bootstrap.json" .Values.tls.enabled) | fromJson }}
{{- $sr := index $b "static_resources" }}
{{- if .Values.tls.enabled }}
{{- $replicaName := include "kvroute.replica.serverName" . }}
{{- range $c := index $sr "clusters" }}
{{- $name := ternary (include "kvroute.router.name" $) $replicaName (has (index $c "name") (list "kvroute_router" "kvroute_picker")) }}
{{- $ctx := index $c "transport_socket" "typed_config" }}
{{- $_ := set $ctx "sni" $name }}
{{- $_ = set (index $ctx "common_tls_context" "validation_context" "match_typed_subject_alt_names" 0 "matcher") "exact" $name }}
{{- end }}
{{- if .Values.tls.mutual }}
{{- $down := index $sr "listeners" 0 "filter_chains" 0 "transport_socket" "typed_config" }}
{{- $_ := set (index $down "common_tls_context") "validation_context" (dict "trusted_ca" (dict "filename" (printf "%s/ca.crt" (include "kvroute.tlsDir" .)))) }}
{{- $_ = set $down "require_client_certificate" true }}
{{- end }}
{{- end }}
{{- $_ := set (index $b "admin" "address" "socket_address") "address" "127.0.0.1" }}
{{- $_ = set (index $b "admin" "address" "socket_address") "port_value" (int $e.adminPort) }}
{{- $front := index $sr "listeners" 0 "address" "socket_address" }}
{{- $_ = set $front "address" "0.0.0.0" }}
{{- $_ = set $front "port_value" (int $e.port) }}
{{- $router := index $sr "clusters" 0 "load_assignment" "endpoints" 0 "lb_endpoints" 0 "endpoint" "address" "socket_address" }}
{{- $_ = set $router "address" (printf "%s.%s.svc" (include "kvroute.router.name" .) .Release.Namespace) }}
{{- $_ = set $router "port_value" (int .Values.router.service.port) }}
{{- $picker := index $sr "clusters" 2 "load_assignment" "endpoints" 0 "lb_endpoints" 0 "endpoint" "address" "socket_address" }}
{{- $_ = set $picker "address" (printf "%s.%s.svc" (include "kvroute.router.name" .) .Release.Namespace) }}
{{- $_ = set $picker "port_value" (int .Values.router.picker.port) }}
{{- $ready := dict "name" "ready" "address" (dict "socket_address" (dict "address" "0.0.0.0" "port_value" (int $e.readyPort))) }}
{{- $readyRoute := dict "match" (dict "path" "/ready") "route" (dict "cluster" "envoy_admin") }}
{{- $readyHcm := dict "@type" "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager" "stat_prefix" "ready" "route_config" (dict "name" "ready" "virtual_hosts" (list (dict "name" "ready" "domains" (list "*") "routes" (list $readyRoute)))) "http_filters" (list (dict "name" "envoy.filters.http.router" "typed_config" (dict "@type" "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"))) }}
{{- $_ = set $ready "filter_chains" (list (dict "filters" (list (dict "name" "envoy.filters.network.http_connection_manager" "typed_config" $readyHcm)))) }}
{{- $admin := dict "name" "envoy_admin" "type" "STATIC" "connect_timeout" "1s" "load_assignment" (dict "cluster_name" "envoy_admin" "endpoints" (list (dict "lb_endpoints" (list (dict "endpoint" (dict "address" (dict "socket_address" (dict "address" "127.0.0.1" "port_value" (int $e.adminPort))))))))) }}
{{- $_ = set $sr "listeners" (append (index $sr "listeners") $ready) }}
{{- $_ = set $sr "clusters" (append (index $sr "clusters") $admin) }}
{{- toPrettyJson $b }}
{{- end }}

{{/* The replica container's resources: replica.resources with replica.gpu devices of
replica.gpuResourceName (the device plugin's resource: nvidia.com/gpu, amd.com/gpu, ...) added to
the limits. */}}
{{- define "kvroute.replica.resources" -}}
{{- $res := deepCopy .Values.replica.resources }}
{{- if gt (int .Values.replica.gpu) 0 }}
{{- $limits := default dict $res.limits }}
{{- $_ := set $limits .Values.replica.gpuResourceName (int .Values.replica.gpu) }}
{{- $_ := set $res "limits" $limits }}
{{- end }}
{{- toYaml $res }}
{{- end }}
