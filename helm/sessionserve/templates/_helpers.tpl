{{- define "sessionserve.fullname" -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "sessionserve.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "sessionserve.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The Secret with the API keys: the user's, or the chart's own. */}}
{{- define "sessionserve.authSecret" -}}
{{- .Values.auth.existingSecret | default (printf "%s-api-keys" (include "sessionserve.fullname" .)) -}}
{{- end -}}

{{/*
One pod template for the head and the GPU workers (no copy-pasted pod specs).
Call with (dict "root" $ "role" "head"|"worker" "resources" ... "nodeSelector" ... "tolerations" ...).
*/}}
{{- define "sessionserve.podTemplate" -}}
{{- $v := .root.Values -}}
metadata:
  labels:
    {{- include "sessionserve.labels" .root | nindent 4 }}
    sessionserve/role: {{ .role }}
spec:
  {{- with .nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if $v.model.initContainer.enabled }}
  initContainers:
    - name: fetch-model
      image: {{ $v.model.initContainer.image | quote }}
      command:
        {{- toYaml $v.model.initContainer.command | nindent 8 }}
      volumeMounts:
        - name: models
          mountPath: {{ $v.model.mountPath | quote }}
  {{- end }}
  containers:
    - name: ray-{{ .role }}
      image: "{{ $v.image.repository }}:{{ $v.image.tag }}"
      imagePullPolicy: {{ $v.image.pullPolicy }}
      resources:
        {{- toYaml .resources | nindent 8 }}
      {{- if $v.auth.enabled }}
      env:
        - name: SESSIONSERVE_API_KEYS
          valueFrom:
            secretKeyRef:
              name: {{ include "sessionserve.authSecret" .root }}
              key: {{ $v.auth.secretKey }}
      {{- end }}
      ports:
        {{- if eq .role "head" }}
        - {name: gcs, containerPort: 6379}
        - {name: dashboard, containerPort: 8265}
        - {name: client, containerPort: 10001}
        - {name: serve, containerPort: 8000}
        {{- end }}
        - {name: metrics, containerPort: 8080}
      volumeMounts:
        - name: models
          mountPath: {{ $v.model.mountPath | quote }}
          readOnly: {{ not $v.model.initContainer.enabled }}
  volumes:
    - name: models
      {{- if and $v.model.pvc.enabled (not $v.model.initContainer.enabled) }}
      persistentVolumeClaim:
        claimName: {{ $v.model.pvc.claimName | quote }}
        readOnly: true
      {{- else }}
      emptyDir: {}
      {{- end }}
{{- end -}}

{{/* The Serve config (serveConfigV2): the `args` are sessionserve's AppConfig. */}}
{{- define "sessionserve.serveConfig" -}}
{{- $v := .Values -}}
{{- $e := $v.engine -}}
proxy_location: EveryNode
http_options:
  host: 0.0.0.0
  port: 8000
logging_config:
  enable_access_log: false
applications:
  - name: sessionserve
    route_prefix: /
    import_path: sessionserve.app:build_app
    args:
      engine:
        model:
          path: {{ $v.model.path | toJson }}
          served_name: {{ if $v.model.servedName }}{{ $v.model.servedName | toJson }}{{ else }}null{{ end }}
          dtype: {{ $v.model.dtype | toJson }}
          device: {{ $v.model.device | toJson }}
        attention_backend: {{ $e.attentionBackend | toJson }}
        memory_check: {{ $e.memoryCheck | toJson }}
        cuda_graphs: {{ $e.cudaGraphs | toJson }}
        compile: {{ $e.compile | toJson }}
        cache:
          page_size: {{ $e.cache.pageSize | toJson }}
          num_slots: {{ $e.cache.numSlots | toJson }}
          max_rows: {{ $e.cache.maxRows | toJson }}
          max_context_len: {{ $e.cache.maxContextLen | toJson }}
          radix_cache: {{ $e.cache.radixCache | toJson }}
          kv_dtype: {{ $e.cache.kvDtype | toJson }}
        sessions:
          max_sessions: {{ $e.sessions.maxSessions | toJson }}
          max_held_tokens: {{ $e.sessions.maxHeldTokens | toJson }}
          max_session_tokens: {{ $e.sessions.maxSessionTokens | toJson }}
          default_ttl_s: {{ $e.sessions.defaultTtlS | toJson }}
          implicit_open: {{ $e.sessions.implicitOpen | toJson }}
          host_tier_bytes: {{ $e.sessions.hostTierBytes | toJson }}
          migrate_on_shutdown_s: {{ $e.sessions.migrateOnShutdownS | toJson }}
        scheduler:
          max_running_requests: {{ $e.scheduler.maxRunningRequests | toJson }}
          max_prefill_tokens: {{ $e.scheduler.maxPrefillTokens | toJson }}
        spec:
          drafter_path: {{ if $e.spec.drafterPath }}{{ $e.spec.drafterPath | toJson }}{{ else }}null{{ end }}
          num_drafts: {{ $e.spec.numDrafts | toJson }}
          history_drafts: {{ $e.spec.historyDrafts | toJson }}
          adaptive: {{ $e.spec.adaptive | toJson }}
      replica:
        num_replicas: {{ $v.replicas.count | toJson }}
        num_cpus: {{ $v.replicas.numCpus | toJson }}
        num_gpus: {{ $v.replicas.numGpus | toJson }}
        max_ongoing_requests: {{ $v.replicas.maxOngoingRequests | toJson }}
        graceful_shutdown_timeout_s: {{ $v.replicas.gracefulShutdownTimeoutS | toJson }}
        {{- if $v.replicas.autoscaling.enabled }}
        autoscaling:
          min_replicas: {{ $v.replicas.autoscaling.minReplicas | toJson }}
          max_replicas: {{ $v.replicas.autoscaling.maxReplicas | toJson }}
          target_ongoing_requests: {{ $v.replicas.autoscaling.targetOngoingRequests | toJson }}
        {{- end }}
      ingress:
        num_replicas: {{ $v.ingress.replicas | toJson }}
        num_cpus: {{ $v.ingress.numCpus | toJson }}
        max_body_bytes: {{ $v.ingress.maxBodyBytes | toJson }}
        max_sessions_per_key: {{ $v.ingress.maxSessionsPerKey | toJson }}
      session_header: {{ $v.sessionHeader | toJson }}
{{- end -}}
