{{/* Names and labels. */}}
{{- define "rollout.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "rollout.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "rollout.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rollout.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "rollout.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "rollout.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "rollout.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}

{{- define "rollout.secretName" -}}
{{- if .Values.secrets.create -}}
{{ include "rollout.fullname" . }}-secrets
{{- else -}}
{{ .Values.secrets.existingSecret }}
{{- end -}}
{{- end -}}

{{- define "rollout.pvcName" -}}
{{- default (printf "%s-model-cache" (include "rollout.fullname" .)) .Values.modelCache.existingClaim -}}
{{- end -}}

{{/* Platform values with the PlatformConfig defaults the chart needs to size pods. */}}
{{- define "rollout.appName" -}}
{{- .Values.platform.app_name | default "rollout" -}}
{{- end -}}

{{- define "rollout.servePort" -}}
{{- (.Values.platform.http | default dict).port | default 8000 | int -}}
{{- end -}}

{{- define "rollout.metricsPort" -}}
{{- (.Values.platform.metrics | default dict).port | default 8080 | int -}}
{{- end -}}

{{- define "rollout.metricsEnabled" -}}
{{- $m := .Values.platform.metrics | default dict -}}
{{- if or (not (hasKey $m "enabled")) $m.enabled -}}true{{- end -}}
{{- end -}}

{{/* The Prometheus operator's objects the chart renders, as "<group>/<version>/<kind>" (the
form .Capabilities.APIVersions.Has and `helm --api-versions` take) -> the value that turns
each off. The one owner of "is it rendered": the two templates and the CRD check in
_validate.tpl all ask here. A ServiceMonitor needs the metrics port (platform.metrics). */}}
{{- define "rollout.monitoringKinds" -}}
{{- $kinds := dict -}}
{{- if and .Values.monitoring.serviceMonitor.enabled (include "rollout.metricsEnabled" .) -}}
{{- $_ := set $kinds "monitoring.coreos.com/v1/ServiceMonitor" "monitoring.serviceMonitor.enabled" -}}
{{- end -}}
{{- if .Values.monitoring.prometheusRule.enabled -}}
{{- $_ := set $kinds "monitoring.coreos.com/v1/PrometheusRule" "monitoring.prometheusRule.enabled" -}}
{{- end -}}
{{- $kinds | toJson -}}
{{- end -}}

{{- define "rollout.routePrefix" -}}
{{- (.Values.platform.http | default dict).route_prefix | default "/" -}}
{{- end -}}

{{- define "rollout.healthPath" -}}
{{- printf "%s/healthz" (include "rollout.routePrefix" . | trimSuffix "/") -}}
{{- end -}}

{{- define "rollout.tp" -}}
{{- .Values.platform.model.tensor_parallel_size | default 1 | int -}}
{{- end -}}

{{- define "rollout.cpuOnly" -}}
{{- if eq (.Values.platform.model.device | default "auto") "cpu" -}}true{{- end -}}
{{- end -}}

{{/* GPUs per worker pod: 0 on CPU, else worker.gpusPerPod or tensor_parallel_size. */}}
{{- define "rollout.gpusPerPod" -}}
{{- if include "rollout.cpuOnly" . -}}0
{{- else if kindIs "invalid" .Values.worker.gpusPerPod -}}{{ include "rollout.tp" . }}
{{- else -}}{{ .Values.worker.gpusPerPod | int }}
{{- end -}}
{{- end -}}

{{/* Engine replicas one worker pod holds: each replica takes tensor_parallel_size GPUs. */}}
{{- define "rollout.replicasPerPod" -}}
{{- if include "rollout.cpuOnly" . -}}1
{{- else -}}{{ max 1 (div (include "rollout.gpusPerPod" . | int) (include "rollout.tp" . | int)) }}
{{- end -}}
{{- end -}}

{{/* Serve replica bounds: autoscaling min/max, or the fixed replica count twice. */}}
{{- define "rollout.replicaBounds" -}}
{{- $d := .Values.platform.deployment | default dict -}}
{{- $a := $d.autoscaling -}}
{{- if kindIs "map" $a -}}
{{- $min := ternary ($a.min_replicas | int) 1 (hasKey $a "min_replicas") -}}
{{- $max := ternary ($a.max_replicas | int) 4 (hasKey $a "max_replicas") -}}
{{- dict "min" $min "max" $max | toJson -}}
{{- else -}}
{{- $n := ternary ($d.replicas | int) 1 (hasKey $d "replicas") -}}
{{- dict "min" $n "max" $n | toJson -}}
{{- end -}}
{{- end -}}

{{/* Worker pods for N replicas: ceil(N / replicasPerPod). */}}
{{- define "rollout.workerCount" -}}
{{- $rpp := include "rollout.replicasPerPod" .ctx | int -}}
{{- div (add .n (sub $rpp 1)) $rpp -}}
{{- end -}}

{{/* Whether the pods get the API key and sync token: a Secret source is configured. Without
one, _validate.tpl has already failed unless auth.required is false. */}}
{{- define "rollout.hasSecret" -}}
{{- if or .Values.secrets.create .Values.secrets.existingSecret -}}true{{- end -}}
{{- end -}}

{{/* Credentials, by reference: head and engine workers only, never the tool workers. */}}
{{- define "rollout.secretEnv" -}}
{{- if include "rollout.hasSecret" . -}}
- name: ROLLOUT_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "rollout.secretName" . }}
      key: {{ .Values.secrets.apiKeyKey }}
{{- /* rollout.config's sync.token_env names the variable the sync coordinator reads. */}}
- name: {{ (.Values.platform.sync | default dict).token_env | default "ROLLOUT_SYNC_TOKEN" }}
  valueFrom:
    secretKeyRef:
      name: {{ include "rollout.secretName" . }}
      key: {{ .Values.secrets.syncTokenKey }}
{{- end -}}
{{- end -}}

{{/* The root filesystem is read-only: caches (HF, vLLM, Triton, torch) go to /tmp. */}}
{{- define "rollout.runtimeEnv" -}}
- name: HOME
  value: /tmp/home
- name: XDG_CACHE_HOME
  value: /tmp/cache
{{- /* Serve's front door (rollout.http.front_door): Serve reads it from every Ray process's
environment, so it is the pods', from the same config the app gets; the ingress refuses to
start where they disagree. */}}
{{- $http := (.Values.platform | default dict).http | default dict }}
- name: RAY_SERVE_ENABLE_HA_PROXY
  value: {{ ternary "1" "0" (eq ($http.front_door | default "serve_proxy") "haproxy") | quote }}
- name: RAY_SERVE_THROUGHPUT_OPTIMIZED
  value: {{ ternary "1" "0" ($http.throughput_optimized | default false) | quote }}
{{- end -}}

{{/* Env of the head and engine worker containers: secrets by reference, writable dirs under
/tmp, and Ray's workers at nice 0 (rollout.local.RAY_WORKER_ENV: Ray starts them at 15, the
engine's processes among them, below everything else on the node; issue 41). */}}
{{- define "rollout.env" -}}
{{- with include "rollout.secretEnv" . }}
{{ . }}
{{- end }}
{{ include "rollout.runtimeEnv" . }}
- name: RAY_worker_niceness
  value: "0"
{{- end -}}

{{/* Where the engine workers' processes keep what they compile and build at engine start
(compileCache): vLLM's compile cache (VLLM_CACHE_ROOT: torch.compile, Inductor and Triton
artifacts), FlashInfer's JIT kernels, Triton's and Inductor's caches outside vLLM's
compile, torch C++ extensions, TVM-FFI's and CUDA's PTX cache. None of these variables is
a factor of vLLM's compile-cache key (VLLM_CACHE_ROOT is ignored by name; the others are
not vLLM's): a replica here finds what `vllm serve` with the same arguments compiled. */}}
{{- define "rollout.compileCacheEnv" -}}
{{- $mp := .Values.compileCache.mountPath -}}
{{- range $name, $dir := dict "VLLM_CACHE_ROOT" "vllm" "FLASHINFER_WORKSPACE_BASE" "flashinfer" "TRITON_CACHE_DIR" "triton" "TORCHINDUCTOR_CACHE_DIR" "inductor" "TORCH_EXTENSIONS_DIR" "torch_extensions" "TVM_FFI_CACHE_DIR" "tvm-ffi" "CUDA_CACHE_PATH" "cuda" }}
- name: {{ $name }}
  value: {{ printf "%s/%s" $mp $dir | quote }}
{{- end }}
{{- end -}}

{{- define "rollout.containerSecurityContext" -}}
{{ toYaml .Values.securityContext }}
{{- end -}}

{{/* Pod-level fields shared by the head and worker templates. */}}
{{- define "rollout.podCommon" -}}
{{- $ := .ctx -}}
{{- $podSecurity := deepCopy ($.Values.podSecurityContext | default dict) }}
{{- with $.Values.syncPorts.ephemeral }}
{{- /* Pins the ports gloo's and NCCL's listeners bind to 0 (the NetworkPolicy opens this
range to trainers): a namespaced "safe" sysctl, allowed under Pod Security restricted. */}}
{{- $range := regexSplit "\\s*-\\s*" (trim .) -1 }}
{{- $_ := set $podSecurity "sysctls" (append ($podSecurity.sysctls | default list) (dict "name" "net.ipv4.ip_local_port_range" "value" (join " " $range))) }}
{{- end }}
securityContext:
  {{- toYaml $podSecurity | nindent 2 }}
{{- with $.Values.imagePullSecrets }}
imagePullSecrets:
  {{- range . }}
  - name: {{ . }}
  {{- end }}
{{- end }}
{{- with .group.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Labels that mark a trainer pod (NetworkPolicy peer; the helm test pod wears them too). */}}
{{- define "rollout.trainerLabels" -}}
{{- toYaml (.Values.networkPolicy.trainerPodLabels | default (dict "rollout-platform/role" "trainer")) -}}
{{- end -}}

{{/* Trainers may authenticate with ServiceAccount tokens: the coordinator (head or a worker
pod) then needs a token of its own allowed to create TokenReviews. */}}
{{- define "rollout.kubeAuth" -}}
{{- $sync := .Values.platform.sync | default dict -}}
{{- if $sync.allowed_service_accounts }}true{{ end -}}
{{- end -}}

{{- define "rollout.syncServiceAccount" -}}
{{ include "rollout.fullname" . }}-sync
{{- end -}}

{{/* The hardened tool worker group (values toolWorkers). */}}
{{- define "rollout.toolsEnabled" -}}
{{- if .Values.toolWorkers.enabled -}}true{{- end -}}
{{- end -}}

{{/* Ray custom resource offered by the head and the engine workers, and asked for by the
Serve deployments that take no CPU (the HTTP ingress, the weight-sync coordinator): they
read the API key and sync token from their node's env, so they must never be placed on a
tool worker, which Ray would otherwise allow (a 0-CPU actor fits anywhere). */}}
{{- define "rollout.serveResource" -}}rollout_serve{{- end -}}

{{/* A rayStartParams `resources` value: KubeRay pastes it into a shell command, so the JSON
is itself quoted, the form of KubeRay's samples: "{\"name\": 1000}". */}}
{{- define "rollout.rayResources" -}}
{{- printf "\"%s\"" (toJson . | replace "\"" "\\\"") -}}
{{- end -}}

{{/* rayStartParams the chart pins on every group while tool workers are on (see rayPorts). */}}
{{- define "rollout.pinnedRayParams" -}}
{{- if include "rollout.toolsEnabled" . -}}
{{- $p := .Values.rayPorts -}}
{{- dict "node-manager-port" (toString $p.nodeManager) "object-manager-port" (toString $p.objectManager) "min-worker-port" (toString $p.minWorker) "max-worker-port" (toString $p.maxWorker) | toJson -}}
{{- else -}}
{}
{{- end -}}
{{- end -}}

{{- define "rollout.toolsServiceAccount" -}}
{{ include "rollout.fullname" . }}-tools
{{- end -}}
